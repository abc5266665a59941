"""Padding-free training: a sequence classifier on variable-length batches, never padded.

Synthetic task: every token id ``v`` has a hidden score ``s[v]``; a sequence's label is
whether the mean score of its tokens is positive. The model embeds the tokens, runs a
``ragged.nn.TransformerEncoder`` on the RaggedTensor, mean-pools each sequence (a segment
mean through ``rt.seq_ids()`` and ``index_add``) and scores it with a Linear layer.

Runs on CPU in seconds, or on a GPU: ``python examples/train_classifier.py --help``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ragged


class Classifier(nn.Module):
    def __init__(self, vocab: int, d_model: int, nhead: int, num_layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = ragged.nn.TransformerEncoderLayer(
            d_model, nhead, 2 * d_model, dropout=0.1, batch_first=True, norm_first=True
        )
        self.encoder = ragged.nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(d_model))
        self.score = nn.Linear(d_model, 1)

    def forward(self, ids: ragged.RaggedTensor) -> torch.Tensor:
        h = self.encoder(ids.with_values(self.embed(ids.values)))  # RaggedTensor [T, d]
        pooled = h.values.new_zeros((h.batch_size, h.values.shape[1]))
        pooled = pooled.index_add(0, h.seq_ids(), h.values)  # per-sequence sums
        pooled = pooled / h.lengths.clamp_min(1).unsqueeze(1).to(pooled.dtype)
        return self.score(pooled).squeeze(1)  # [B] logits


def batch(scores: torch.Tensor, size: int, max_len: int, gen: torch.Generator, device):
    """Token-id sequences of lengths 1..max_len (lengths known on the host: no device read)."""
    lengths = torch.randint(1, max_len + 1, (size,), generator=gen).tolist()
    seqs = [torch.randint(0, scores.shape[0], (n,), generator=gen) for n in lengths]
    labels = torch.stack([(scores[s].mean() > 0).float() for s in seqs])
    ids = ragged.pack([s.to(device) for s in seqs])  # one torch.cat
    return ids, labels.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    vocab = 64
    scores = torch.randn(vocab, generator=gen)
    model = Classifier(vocab, args.d_model, 4, args.layers).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    losses = []
    for step in range(1, args.steps + 1):
        ids, labels = batch(scores, args.batch, args.max_len, gen, args.device)
        loss = F.binary_cross_entropy_with_logits(model(ids), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == 1:
            recent = losses[-25:]
            print(
                f"step {step:4d}  mean loss of the last {len(recent):2d} steps {sum(recent) / len(recent):.4f}  "
                f"({ids.num_tokens} tokens, "
                f"longest {ids.max_len})"
            )

    model.eval()
    with torch.no_grad():
        ids, labels = batch(scores, 512, args.max_len, gen, args.device)
        accuracy = ((model(ids) > 0).float() == labels).float().mean().item()
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    print(
        f"mean training loss of the first 10 steps {first:.4f} -> of the last 10 steps {last:.4f}; "
        f"held-out accuracy {accuracy:.1%}"
    )
    if not last < first:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
