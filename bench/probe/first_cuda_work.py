"""Where a fresh process's first GPU work spends its time (one process, one GPU), printed as JSON."""
import json
import time

t0 = time.perf_counter()
marks = {}


def mark(name):
    marks[name] = round(time.perf_counter() - t0, 3)


import torch  # noqa: E402

mark("import_torch")
torch.cuda.set_device(0)
mark("set_device")
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
mark("first_tensor")
torch.backends.cudnn.benchmark = True
conv = torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
                           torch.nn.Flatten(), torch.nn.Linear(32 * 64, 10)).cuda()
mark("model_to_cuda")
inp = torch.randn(256, 1, 8, 8, device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = conv(inp)
torch.cuda.synchronize()
mark("first_forward")
out.float().sum().backward()
torch.cuda.synchronize()
mark("first_backward")
opt = torch.optim.SGD(conv.parameters(), lr=0.1, momentum=0.9)
opt.step()
torch.cuda.synchronize()
mark("first_optimizer_step")
with torch.autocast("cuda", dtype=torch.bfloat16):
    out = conv(inp)
out.float().sum().backward()
torch.cuda.synchronize()
mark("second_step")
print(json.dumps({"what": "first_cuda_work", **marks, "torch": torch.__version__}))
