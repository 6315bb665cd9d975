"""PyTorch's side of `tessera bench resnet`: a torchvision-free ResNet-18/50
(torchvision's architecture: 7x7/2 stem, batch norm, ReLU, 3x3/2 max pool,
basic or bottleneck blocks with the stride on the 3x3 conv, global average
pool, linear head), eager, on the CPU, timed two ways on a random batch:

  --task inference   model.eval(), torch.inference_mode(), forward
  --task train       model.train(), zero_grad, forward, cross-entropy,
                     backward, SGD (lr 0.01, momentum 0.9) step

`--warmup` untimed runs, then `--steps` timed ones; the median is the
figure. Prints one JSON line with the fields `tessera bench resnet` prints.

    python scripts/anchors/resnet_torch.py --depth 50 --task inference \
        --batch 8 --image 224 --threads 2
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Basic(nn.Module):
    expansion = 1

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.down = None
        if stride != 1 or cin != planes:
            self.down = nn.Sequential(
                nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, planes, stride):
        super().__init__()
        out = planes * 4
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.down = None
        if stride != 1 or cin != out:
            self.down = nn.Sequential(
                nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, depth, classes):
        super().__init__()
        block, layers = {18: (Basic, [2, 2, 2, 2]), 50: (Bottleneck, [3, 4, 6, 3])}[depth]
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks, cin = [], 64
        for stage, n in enumerate(layers):
            planes = 64 << stage
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(block(cin, planes, stride))
                cin = planes * block.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.blocks(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--depth", type=int, default=50)
    p.add_argument("--task", choices=["inference", "train"], default="inference")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = ResNet(a.depth, a.classes)
    x = torch.randn(a.batch, 3, a.image, a.image)
    y = torch.arange(a.batch) % a.classes
    times, last = [], 0.0
    if a.task == "inference":
        model.eval()
        for i in range(a.warmup + a.steps):
            t = time.perf_counter()
            with torch.inference_mode():
                last = model(x).mean().item()
            ms = (time.perf_counter() - t) * 1e3
            if i >= a.warmup:
                times.append(ms)
    else:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for i in range(a.warmup + a.steps):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            last = loss.item()
            ms = (time.perf_counter() - t) * 1e3
            if i >= a.warmup:
                times.append(ms)
    times.sort()
    med = times[len(times) // 2]
    print(
        json.dumps(
            {
                "framework": f"pytorch {torch.__version__} eager",
                "model": f"resnet{a.depth}",
                "task": a.task,
                "batch": a.batch,
                "image": a.image,
                "threads": torch.get_num_threads(),
                "ms_median": med,
                "ms_min": times[0],
                "images_per_s": a.batch / (med / 1e3),
                "last_value": last,
                "load": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
