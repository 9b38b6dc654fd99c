//! The `host` command line. Only argument parsing lives here; the work is in
//! the library.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "host",
    version,
    about = "AlexNet training in pure Rust on NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the visible GPUs (name, compute capability, memory, SMs, driver).
    Devices,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Devices => host::cli::devices(),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
