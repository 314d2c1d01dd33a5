"""Tiny fp16 failure-mode models for the headroom lead-time study (review 61f; README "How early it warns"): `task.options.kind` mlp, resid or attn."""
import torch
from torch import nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d=16, w=32, c=8):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(d, w), nn.Linear(w, w), nn.Linear(w, c)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Resid(nn.Module):
    """A residual stream with no normalisation: h = h + W_i relu(h), four blocks."""
    def __init__(self, d=16, w=32, n=4):
        super().__init__()
        self.inp = nn.Linear(d, w)
        self.blocks = nn.ModuleList(nn.Linear(w, w) for _ in range(n))
        self.head = nn.Linear(w, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(F.relu(h))
        return self.head(h)


class Attn(nn.Module):
    """One attention layer, logits q @ k^T without 1/sqrt(d) (the q.k scale forgotten)."""
    def __init__(self, vocab=16, length=8, d=16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.tok(x) + self.pos.weight[: x.size(1)]
        q, k, v = self.q(h), self.k(h), self.v(h)
        logits = q @ k.transpose(-2, -1)
        att = torch.softmax(logits, dim=-1)
        return self.head((att @ v)[:, -1])


def build(config):
    o = config.task.options
    kind = o.get("kind", "mlp")
    g = torch.Generator().manual_seed(7)
    torch.manual_seed(config.seed)
    bs, n = 32, 8
    if kind == "mlp":
        model = MLP(c=1)
        xs = torch.randn(n * bs, 16, generator=g)
        ys = xs[:, :1] * xs[:, 1:2]  # a regression; SGD at too high an LR diverges, slowly
        loss_fn = lambda out, y: F.mse_loss(out.float(), y)  # noqa: E731
    elif kind == "resid":
        model = Resid()
        xs = torch.randn(n * bs, 16, generator=g)
        ys = (xs[:, :1] * float(o.get("target", 1.0)))  # unnormalised regression target
        loss_fn = lambda out, y: F.mse_loss(out.float(), y)  # noqa: E731
    elif kind == "attn":
        model = Attn()
        xs = torch.randint(0, 16, (n * bs, 8), generator=g)
        ys = xs[:, 0].clone()  # copy the first token: attention must grow sharp
        loss_fn = lambda out, y: F.cross_entropy(out.float(), y)  # noqa: E731
    else:
        raise ValueError(kind)
    data = [(xs[i * bs:(i + 1) * bs], ys[i * bs:(i + 1) * bs]) for i in range(n)]
    return {"model": model, "data": data, "loss_fn": loss_fn}
