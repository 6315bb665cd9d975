"""PyTorch's side of `tessera bench resnet`: a torchvision-free ResNet-18/50
(torchvision's architecture: 7x7/2 stem, batch norm, ReLU, 3x3/2 max pool,
basic or bottleneck blocks with the stride on the 3x3 conv, global average
pool, linear head), on the CPU or the GPU, eager or torch.compile, timed two
ways on a random batch:

  --task inference   model.eval(), torch.inference_mode(), forward
  --task train       model.train(), zero_grad, forward, cross-entropy,
                     backward, SGD (lr 0.01, momentum 0.9) step

--dtype bf16|f16 puts the parameters, the batch-norm statistics and the batch
in that dtype (model.to(dtype)), as `tessera bench resnet --dtype` does.
--mode compile runs torch.compile(model) (the default inductor backend; the
loss, backward call and optimizer step stay eager); --mode reduce-overhead
adds CUDA graphs (torch.compile's mode="reduce-overhead", the peer of
`tessera bench resnet --cuda-graphs`). f32 convolutions and
matmuls run without TF32 (as tessera's f32: CUDNN_FMA_MATH and
CUBLAS_COMPUTE_32F); cudnn.benchmark stays off (as tessera, which takes
cuDNN's heuristic choice).

`--warmup` untimed runs, then `--steps` timed ones; the median is the
figure. Every run reads its result back (.item(), which waits for the GPU).
Prints one JSON line with the fields `tessera bench resnet` prints.

    python scripts/anchors/resnet_torch.py --depth 50 --task inference \
        --batch 8 --image 224 --threads 2
    python scripts/anchors/resnet_torch.py --device cuda --mode compile \
        --depth 50 --batch 32 --dtype bf16
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


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


def profile(run, device):
    """The device (or CPU) time by kernel over 3 steps, largest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(3):
            run()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=90), file=sys.stderr)


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
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default="f32")
    p.add_argument("--mode", choices=["eager", "compile", "reduce-overhead"], default="eager")
    p.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, the device time by kernel of 3 more (torch.profiler) to stderr",
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dtype = DTYPES[a.dtype]
    model = ResNet(a.depth, a.classes).to(a.device, dtype)
    x = torch.randn(a.batch, 3, a.image, a.image).to(a.device, dtype)
    y = (torch.arange(a.batch) % a.classes).to(a.device)
    net = {
        "eager": model,
        "compile": torch.compile(model),
        "reduce-overhead": torch.compile(model, mode="reduce-overhead"),
    }[a.mode]
    times, last, first = [], 0.0, 0.0
    if a.task == "inference":
        model.eval()

        def run():
            with torch.inference_mode():
                return net(x).float().mean().item()

    else:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def run():
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            return loss.item()

    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        last = run()
        ms = (time.perf_counter() - t) * 1e3
        if i == 0:
            first = ms
        if i >= a.warmup:
            times.append(ms)
    times.sort()
    med = times[len(times) // 2]
    if a.profile:
        profile(run, a.device)
    print(
        json.dumps(
            {
                "framework": f"pytorch {torch.__version__} {a.mode}",
                "model": f"resnet{a.depth}",
                "task": a.task,
                "batch": a.batch,
                "image": a.image,
                "device": a.device,
                "dtype": a.dtype,
                "threads": torch.get_num_threads(),
                "ms_median": med,
                "ms_min": times[0],
                "images_per_s": a.batch / (med / 1e3),
                "first_ms": first,
                "last_value": last,
                "load": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
