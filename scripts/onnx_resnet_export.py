#!/usr/bin/env python3
"""ResNet-50 (torchvision's architecture, written out here: no torchvision
needed) exported from PyTorch to ONNX, and ONNX Runtime's latency on it:
the peer of `tessera run resnet50.onnx --bench N`.

usage: onnx_resnet_export.py OUT_DIR [BATCH ...]

Writes OUT_DIR/resnet50.onnx (random weights and batch-norm statistics,
seed 0; eval mode; a dynamic batch dim; input `x` [B, 3, 224, 224], output
`logits` [B, 1000]), OUT_DIR/x_B.npy and OUT_DIR/ort_logits_B.npy for each
batch size B (default 1 and 32), and prints ONNX Runtime's median latency
(CPU, intra-op threads = the machine's cores; its CUDA provider with
ORT_DEVICE=cuda, inputs and outputs in GPU memory) of 5 runs after 2 warm-ups.
Compare tessera's output with `onnx_resnet_export.py --compare A.npy B.npy`.
"""

import os
import sys

import numpy as np
import torch
import torch.nn as nn
from ort_bench import device, session, timed


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        layers, cin = [], 64
        for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def randomise_batch_norms(model):
    """Running statistics and affine weights of their own (fresh ones are
    0/1, which would hide a wrong fold)."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.weight.data.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.1)


def compare(a, b):
    x, y = np.load(a), np.load(b)
    scale = max(np.abs(y).max(), 1e-30)
    err = np.abs(x.astype(np.float64) - y).max() / scale
    print(f"max |a - b| / max |b| = {err:.2e} ({x.shape} vs {y.shape})")
    sys.exit(0 if x.shape == y.shape and err <= 1e-4 else 1)


def main():
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    out = sys.argv[1]
    batches = [int(b) for b in sys.argv[2:]] or [1, 32]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = ResNet50().eval()
    randomise_batch_norms(model)
    path = os.path.join(out, "resnet50.onnx")
    torch.onnx.export(
        model,
        (torch.zeros(2, 3, 224, 224),),
        path,
        input_names=["x"],
        output_names=["logits"],
        dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    import onnxruntime as ort

    sess = session(path)
    rng = np.random.default_rng(0)
    for b in batches:
        x = rng.standard_normal((b, 3, 224, 224), dtype=np.float32)
        np.save(os.path.join(out, f"x_{b}.npy"), x)
        logits, median = timed(sess, {"x": x}, 2, 5)
        np.save(os.path.join(out, f"ort_logits_{b}.npy"), logits)
        with torch.no_grad():
            ref = model(torch.from_numpy(x)).numpy()
        print(
            f"onnxruntime {ort.__version__} ({device()}) batch {b}: median {median:.3f} ms "
            f"(max |ORT - torch| {np.abs(logits - ref).max():.2e})"
        )


if __name__ == "__main__":
    main()
