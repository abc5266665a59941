"""Quick start: pack a ragged batch, run per-token work on the real tokens only, unpack.

Runs on CPU or GPU: ``python examples/quickstart.py``.
"""

import torch

import ragged

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# A batch of sentences of different lengths, each token a 768-wide embedding.
seqs = [torch.randn(n, 768, device=device) for n in (5, 0, 31, 12)]
rt = ragged.pack(seqs)
print(rt)
print("offsets:", rt.offsets.tolist(), "max_len:", rt.max_len)

# Per-token layers run on rt.values: 48 rows instead of 4 x 31 = 124 padded rows.
proj = torch.nn.Linear(768, 256, device=device)
out = rt.with_values(torch.relu(proj(rt.values)))

# Back to the padded layout only where something needs it.
padded = out.to_padded()  # [4, 31, 256], zeros at padding
assert padded.shape == (4, 31, 256)
for b, seq in enumerate(seqs):
    expected = torch.relu(proj(seq))
    torch.testing.assert_close(padded[b, : seq.shape[0]], expected)
    assert torch.all(padded[b, seq.shape[0] :] == 0)

# From a padded batch and a HuggingFace-style attention mask (1 = token).
mask = rt.attention_mask()
again = ragged.pack(rt.to_padded(), attention_mask=mask)
assert torch.equal(again.values, rt.values)
print("position ids of sequence 0:", rt.position_ids()[: rt.host_lengths()[0]].tolist())
print("flash-attn kwargs:", {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in rt.flash_kwargs().items()})
print("ok")
