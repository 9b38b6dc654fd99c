//! CPU reference: softmax + cross-entropy, and the rank of the true label.
//!
//! `logits`, `probs` and `scores` are `[n, classes]` row-major; `labels`,
//! `loss` and `rank` have one entry per row. Softmax is computed stably
//! (subtracting the row maximum, sums in f64), and the loss as
//! `logsumexp(row) − logit[label]` rather than `−ln` of a rounded probability,
//! so it stays accurate when the true class's probability underflows.

use rayon::prelude::*;

fn check_label(row: usize, label: i32, classes: usize) -> usize {
    assert!(
        label >= 0 && (label as usize) < classes,
        "loss: label {label} of row {row} is outside [0, {classes})"
    );
    label as usize
}

fn check_lens(what: &str, n: usize, classes: usize, matrix: usize, labels: usize) {
    assert!(
        matrix == n * classes && labels == n,
        "{what}: buffers of {matrix} values and {labels} labels for {n} rows of {classes} classes"
    );
}

/// Row-wise softmax into `probs` and `loss[i] = −ln probs[i, labels[i]]`
/// (overwrites both).
pub fn softmax_xent_forward(
    n: usize,
    classes: usize,
    logits: &[f32],
    labels: &[i32],
    probs: &mut [f32],
    loss: &mut [f32],
) {
    check_lens(
        "softmax_xent_forward",
        n,
        classes,
        logits.len(),
        labels.len(),
    );
    check_lens("softmax_xent_forward", n, classes, probs.len(), loss.len());
    if classes == 0 {
        return;
    }
    probs
        .par_chunks_mut(classes)
        .zip(loss.par_iter_mut())
        .enumerate()
        .for_each(|(i, (p_row, loss_i))| {
            let label = check_label(i, labels[i], classes);
            let row = &logits[i * classes..][..classes];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            for (p, &v) in p_row.iter_mut().zip(row) {
                *p = ((v as f64 - max).exp() / sum) as f32;
            }
            *loss_i = (sum.ln() - (row[label] as f64 - max)) as f32;
        });
}

/// Gradient of the mean loss: `dlogits = (probs − onehot(labels)) / n`
/// (overwrites `dlogits`).
pub fn softmax_xent_backward(
    n: usize,
    classes: usize,
    probs: &[f32],
    labels: &[i32],
    dlogits: &mut [f32],
) {
    check_lens(
        "softmax_xent_backward",
        n,
        classes,
        probs.len(),
        labels.len(),
    );
    check_lens(
        "softmax_xent_backward",
        n,
        classes,
        dlogits.len(),
        labels.len(),
    );
    if classes == 0 {
        return;
    }
    let inv_n = 1.0 / n as f64;
    dlogits
        .par_chunks_mut(classes)
        .enumerate()
        .for_each(|(i, d_row)| {
            let label = check_label(i, labels[i], classes);
            for (j, d) in d_row.iter_mut().enumerate() {
                let onehot = if j == label { 1.0 } else { 0.0 };
                *d = ((probs[i * classes + j] as f64 - onehot) * inv_n) as f32;
            }
        });
}

/// `rank[i]` = number of classes scoring strictly higher than `labels[i]`
/// (overwrites `rank`; top-k correct ⇔ `rank < k`).
pub fn label_rank(n: usize, classes: usize, scores: &[f32], labels: &[i32], rank: &mut [f32]) {
    check_lens("label_rank", n, classes, scores.len(), labels.len());
    check_lens("label_rank", n, classes, n * classes, rank.len());
    for (i, r) in rank.iter_mut().enumerate() {
        let label = check_label(i, labels[i], classes);
        let row = &scores[i * classes..][..classes];
        *r = row.iter().filter(|&&s| s > row[label]).count() as f32;
    }
}
