#!/usr/bin/env python3
"""A GPT-style transformer exported from PyTorch to ONNX, and ONNX Runtime's
latency on it: the peer of `tessera run model.onnx --bench N`.

usage: onnx_gpt_export.py OUT_DIR [BATCH ...]

Writes OUT_DIR/gpt.onnx (random weights, seed 0; a dynamic batch dim),
OUT_DIR/tokens_B.npy (int64 [B, 128]) and OUT_DIR/ort_logits_B.npy for each
batch size B (default 1 and 32), and prints ONNX Runtime's median latency
(CPU, intra-op threads = the machine's cores; its CUDA provider with
ORT_DEVICE=cuda, inputs and outputs in GPU memory) of 10 runs after 3 warm-ups.
"""

import os
import sys

import numpy as np
import torch
import torch.nn as nn
from ort_bench import device, session, timed

VOCAB, D, HEADS, LAYERS, SEQ = 1024, 256, 4, 4, 128


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)
        mask = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q = q.view(b, t, HEADS, D // HEADS).transpose(1, 2)
        k = k.view(b, t, HEADS, D // HEADS).transpose(1, 2)
        v = v.view(b, t, HEADS, D // HEADS).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / (D // HEADS) ** 0.5
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(y)
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def main():
    out = sys.argv[1]
    batches = [int(b) for b in sys.argv[2:]] or [1, 32]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = GPT().eval()
    path = os.path.join(out, "gpt.onnx")
    example = torch.zeros(2, SEQ, dtype=torch.int64)
    torch.onnx.export(
        model,
        (example,),
        path,
        input_names=["tokens"],
        output_names=["logits"],
        dynamic_axes={"tokens": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    import onnxruntime as ort

    sess = session(path)
    rng = np.random.default_rng(0)
    for b in batches:
        tokens = rng.integers(0, VOCAB, size=(b, SEQ), dtype=np.int64)
        np.save(os.path.join(out, f"tokens_{b}.npy"), tokens)
        logits, median = timed(sess, {"tokens": tokens}, 3, 10)
        np.save(os.path.join(out, f"ort_logits_{b}.npy"), logits)
        with torch.no_grad():
            ref = model(torch.from_numpy(tokens)).numpy()
        print(
            f"onnxruntime {ort.__version__} ({device()}) batch {b}: median {median:.3f} ms "
            f"(max |ORT - torch| {np.abs(logits - ref).max():.2e})"
        )


if __name__ == "__main__":
    main()
