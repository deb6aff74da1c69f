"""Would loading cuDNN's libraries in the forkserver (before any worker forks, without touching CUDA)
shorten a worker's first convolution? Alternating fresh runs, JSON lines.

    python bench/probe/cudnn_preload.py             # 3 runs each way, alternating

Each run: a parent imports torch (as launch's forkserver does), dlopens cuDNN's libraries or not,
then forks a child that initializes CUDA and times its first conv forward + backward + optimizer step.
"""
import ctypes
import glob
import json
import os
import subprocess
import sys
import time


def cudnn_libraries() -> list[str]:
    found = []
    for root in sys.path:
        found += glob.glob(os.path.join(root, "nvidia", "**", "libcudnn*.so*"), recursive=True)
    # the core library first, then the ones it loads on demand
    return sorted(set(found), key=lambda p: (not os.path.basename(p).startswith("libcudnn.so"), p))


def child_run(preload: bool) -> None:
    import torch

    loaded, start = [], time.perf_counter()
    if preload:
        for path in cudnn_libraries():
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                loaded.append(os.path.basename(path))
            except OSError:
                pass
    preload_s = time.perf_counter() - start
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        t0 = time.perf_counter()
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        cuda_s = time.perf_counter() - t0
        torch.backends.cudnn.benchmark = True
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
                                  torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1),
                                  torch.nn.Flatten(), torch.nn.Linear(64, 10))
        net = net.cuda().to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(512, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last)
        t1 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x).float().sum()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        os.write(write, json.dumps({"cuda_init_s": round(cuda_s, 3),
                                    "first_step_s": round(time.perf_counter() - t1, 3)}).encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 4096):
        data += chunk
    os.waitpid(pid, 0)
    print(json.dumps({"what": "cudnn_preload", "preload": preload, "preload_s": round(preload_s, 3),
                      "libraries": len(loaded), **json.loads(data)}), flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_run(sys.argv[2] == "yes")
        return
    for _ in range(3):
        for mode in ("no", "yes"):
            subprocess.run([sys.executable, __file__, "--child", mode], check=True)


if __name__ == "__main__":
    main()
