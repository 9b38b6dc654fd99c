"""The same AlexNet in PyTorch, for side-by-side numbers with `host bench`.

Built from configs/alexnet.json (LRN: PyTorch's alpha = size x the config's
alpha; grouped convs; 224x224 input, conv1 padded by 2). Times one SGD step
(forward, backward, momentum update) on synthetic data already on the GPU,
with CUDA events, median of --steps after warm-up, for fp32 (TF32 off), TF32
and bf16 autocast. `--check CKPT` also loads one of our checkpoints into the
model (PyTorch names and layouts) and reports it.

    python3 benches/pytorch_reference.py --batch-size 128 256 --layers
"""

import argparse
import json
import statistics

import torch
from torch import nn


def build(cfg):
    layers, c = [], cfg["model"]["input"]["channels"]
    names = []
    for l in cfg["model"]["layers"]:
        t = l["type"]
        if t == "conv":
            m = nn.Conv2d(c, l["filters"], l["size"], l.get("stride", 1), l.get("pad", 0), groups=l.get("groups", 1))
            nn.init.normal_(m.weight, 0.0, l["init_std"])
            nn.init.constant_(m.bias, l["init_bias"])
            c = l["filters"]
        elif t == "fc":
            m = nn.LazyLinear(l["outputs"])
            m._init = (l["init_std"], l["init_bias"])
        elif t == "relu":
            m = nn.ReLU(inplace=True)
        elif t == "lrn":
            m = nn.LocalResponseNorm(l["size"], alpha=l["alpha"] * l["size"], beta=l["beta"], k=l["k"])
        elif t == "maxpool":
            m = nn.MaxPool2d(l["size"], l["stride"])
        elif t == "dropout":
            m = nn.Dropout(l["p"])
        elif t == "softmax":
            continue
        else:
            raise ValueError(t)
        if t == "fc" and not any(isinstance(x, nn.Flatten) for x in layers):
            layers.append(nn.Flatten())
            names.append("flatten")
        layers.append(m)
        names.append(l["name"])
    return nn.Sequential(*layers), names


def model_for(cfg, device):
    seq, names = build(cfg)
    inp = cfg["model"]["input"]
    seq = seq.to(device)
    seq(torch.zeros(1, inp["channels"], inp["height"], inp["width"], device=device))
    for m in seq:
        if isinstance(m, nn.Linear):
            std, bias = m._init
            nn.init.normal_(m.weight, 0.0, std)
            nn.init.constant_(m.bias, bias)
    # Parameter names as in our checkpoints: <layer>.weight / <layer>.bias.
    named = nn.Module()
    for name, m in zip(names, seq):
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            named.add_module(name, m)
    return seq, named


def timed(fn, steps, warmup=3):
    """Median milliseconds of `fn` over `steps` runs (CUDA events) after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def step_time(cfg, batch, precision, steps, device):
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = True
    model, _ = model_for(cfg, device)
    inp = cfg["model"]["input"]
    x = torch.randn(batch, inp["channels"], inp["height"], inp["width"], device=device)
    y = torch.randint(0, cfg["model"]["classes"], (batch,), device=device)
    t = cfg["train"]
    opt = torch.optim.SGD(model.parameters(), lr=t["lr"], momentum=t["momentum"], weight_decay=t["weight_decay"])
    loss_fn = nn.CrossEntropyLoss()

    def one():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    ms = timed(one, steps, warmup=5)
    return {"precision": precision, "batch": batch, "median_step_ms": ms, "images_per_sec": batch / ms * 1e3}


def kernels_of(fn):
    """(name, device µs) of each kernel one call of `fn` launches, from
    torch.profiler, after one untimed call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            t = next((getattr(e, a) for a in ("device_time", "device_time_total", "cuda_time") if hasattr(e, a)), 0.0)
            out.append((e.name, t))
    return out


def conv_layer_times(cfg, batch, precision, steps, device, kernels=False):
    """cuDNN's forward, data-gradient and weight-gradient time of every conv
    layer at its place in the network (the same calls autograd makes)."""
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.benchmark = True
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    seq, names = build(cfg)
    model = seq.to(device)
    inp = cfg["model"]["input"]
    x = torch.randn(batch, inp["channels"], inp["height"], inp["width"], device=device)
    rows = []
    with torch.no_grad():
        for name, m in zip(names, model):
            if isinstance(m, nn.Linear):
                break
            if isinstance(m, nn.Conv2d):
                xi = x.to(dtype)
                w = m.weight.to(dtype)
                y = torch.nn.functional.conv2d(xi, w, None, m.stride, m.padding, 1, m.groups)
                dy = torch.randn_like(y)
                args = (dy, xi, w, None, m.stride, m.padding, (1, 1), False, (0, 0), m.groups)
                fwd = timed(lambda: torch.nn.functional.conv2d(xi, w, None, m.stride, m.padding, 1, m.groups), steps)
                dgrad = timed(lambda: torch.ops.aten.convolution_backward(*args, [True, False, False]), steps)
                wgrad = timed(lambda: torch.ops.aten.convolution_backward(*args, [False, True, False]), steps)
                row = {"layer": name, "precision": precision, "batch": batch, "forward_ms": fwd, "data_grad_ms": dgrad, "weight_grad_ms": wgrad}
                if kernels:
                    products = {
                        "forward": lambda: torch.nn.functional.conv2d(xi, w, None, m.stride, m.padding, 1, m.groups),
                        "data_grad": lambda: torch.ops.aten.convolution_backward(*args, [True, False, False]),
                        "weight_grad": lambda: torch.ops.aten.convolution_backward(*args, [False, True, False]),
                    }
                    row["kernels"] = {k: kernels_of(f) for k, f in products.items()}
                rows.append(row)
            x = m(x)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/alexnet.json")
    p.add_argument("--batch-size", type=int, nargs="+", default=[128, 256])
    p.add_argument("--precision", nargs="+", default=["fp32", "tf32", "bf16"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--check", help="load one of our checkpoints into the model and report")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--layers", action="store_true", help="also time every conv layer's forward, data and weight gradient in cuDNN")
    p.add_argument("--kernels", action="store_true", help="with --layers: also list the kernels (name, µs) each of those products launches")
    a = p.parse_args()
    cfg = json.load(open(a.config))
    device = "cuda"
    print(f"PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    if a.check:
        from safetensors.torch import load_file

        _, named = model_for(cfg, device)
        state = {k: v for k, v in load_file(a.check).items() if not k.endswith(".momentum")}
        named.load_state_dict(state, strict=True)
        print(f"{a.check}: {len(state)} tensors loaded (strict)")
    rows = []
    for precision in a.precision:
        for b in a.batch_size:
            r = step_time(cfg, b, precision, a.steps, device)
            print(f"{precision:>5} batch {b:>4}: {r['median_step_ms']:.2f} ms  {r['images_per_sec']:.0f} img/s")
            rows.append(r)
    if a.layers:
        for precision in a.precision:
            for b in a.batch_size:
                for r in conv_layer_times(cfg, b, precision, a.steps, device, a.kernels):
                    print(f"{precision:>5} batch {b:>4} {r['layer']:>6}: fwd {r['forward_ms']:.3f} ms  data-grad {r['data_grad_ms']:.3f} ms  weight-grad {r['weight_grad_ms']:.3f} ms")
                    for product, ks in r.get("kernels", {}).items():
                        for name, us in ks:
                            print(f"      {product:<11} {us:8.1f} us  {name}")
                    rows.append(r)
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
