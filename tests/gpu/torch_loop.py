"""A small PyTorch training loop and an elementwise loop on the GPU (CPU where there is none):
thousands of Python calls inside torch, C++→Python callbacks included. Deterministic: same
calls on every run."""
import torch


def step(model, x, opt):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def main():
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 30 * 30, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 3, 32, 32, device=dev)
    for _ in range(50):
        step(model, x, opt)
    a = torch.randn(512, 512, device=dev)
    for _ in range(100):
        b = torch.relu(a @ a) / 2
    if dev == "cuda":
        torch.cuda.synchronize()
    print("done", float(b.sum()) != 0)


main()
