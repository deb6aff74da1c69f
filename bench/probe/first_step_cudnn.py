"""How much of a fresh process's first training step is cuDNN autotuning? The digits recipe's model,
bf16 autocast, first 2 steps timed, one fresh process per setting (alternating), JSON lines.

    python bench/probe/first_step_cudnn.py
"""
import json
import subprocess
import sys
import time


def child(setting: str) -> None:
    import torch

    from launcher.host.compose import config_for
    from launcher.recipes.digits import Digits

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    torch.backends.cudnn.benchmark = setting != "benchmark_off"
    if setting == "benchmark_limit_1":
        torch.backends.cudnn.benchmark_limit = 1
    net = Digits(config_for("recipe=digits")).build_model(10).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(32, 1, 8, 8, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    times = []
    for _ in range(2):
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(net(x).float(), y)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t, 3))
    print(json.dumps({"what": "first_step_cudnn", "setting": setting, "step_1_s": times[0], "step_2_s": times[1]}),
          flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        for _ in range(2):
            for setting in ("benchmark_on", "benchmark_off", "benchmark_limit_1"):
                subprocess.run([sys.executable, __file__, "--child", setting], check=True)
