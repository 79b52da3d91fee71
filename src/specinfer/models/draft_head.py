"""Feature-level draft heads (the EAGLE family): a small model that drafts from the LLM's own features.

Terms. The LLM's *feature* at position j, ``f_j``, is its last hidden state at token ``x_j`` after the
final norm: what its LM head reads (:meth:`specinfer.models.native.backend.NativeBackend.forward_tree_features`).
A *pair* j is ``(f_j, x_{j+1})``: a feature and the token that followed it. The head reads pair j at RoPE
position j and predicts ``f_{j+1}``; the LLM's own LM head turns that prediction into logits for
``x_{j+2}``. So from the pairs of the committed text (true features) the head drafts the token after the
next one, and a drafted token with the feature the head predicted for it forms the next pair, down a tree.

Architecture (EAGLE-1's, with its two inputs normed apart: Gemma scales its embeddings by sqrt(hidden)
while features come out of a norm): ``x = fc([rms(f); rms(E(t))])``, one Llama decoder layer over ``x``
(RoPE attention with grouped KV heads, SwiGLU MLP), a final RMSNorm and a projection to the feature
width. The LLM's embedding table ``E`` and LM head are reused, frozen; the head owns only the above,
so its width is its own (a narrow head for a wide LLM is cheap to train and to run).

A checkpoint is a folder with ``config.json`` (``"model_type": "specinfer_draft_head"`` and
:class:`HeadConfig`'s fields) and ``model.safetensors``, and optionally ``draft_vocab.safetensors``: its *draft
vocabulary*, the token IDs the head drafts from (its corpus's most frequent, :func:`frequent_tokens`). Drafting then
multiplies by those rows of the LM head alone (as FR-Spec, Zhao et al. 2025, does for EAGLE-2): on a 49 k
vocabulary and 8 k draft tokens, a sixth of the LM head's bytes per depth. Drafts outside it get probability 0; the
LLM's verification is unchanged, so outputs are too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

MODEL_TYPE = "specinfer_draft_head"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


@dataclass(frozen=True)
class HeadConfig:
    """A head's shape. ``feature_dim``: the LLM's LM-head input width (its features' and embeddings'
    width); ``vocab_size``: the LLM's; ``llm``: what it was trained for (the LLM's ``model_type``,
    layers, hidden size and vocabulary, :func:`llm_signature`), checked when a server loads it."""

    feature_dim: int
    vocab_size: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    llm: str = ""

    def __post_init__(self) -> None:
        if min(self.feature_dim, self.vocab_size, self.hidden, self.heads, self.kv_heads, self.head_dim) < 1:
            raise ValueError(f"invalid head config {self}")
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads}), head_dim even")


def llm_signature(config: dict) -> str:
    """What identifies an LLM for its heads: its family, depth, width and vocabulary (from its config.json)."""
    text = config.get("text_config") or config
    return (
        f"{config.get('model_type')}/layers={text.get('num_hidden_layers')}/hidden={text.get('hidden_size')}"
        f"/vocab={text.get('vocab_size')}"
    )


class DraftHead(nn.Module):
    """The head's weights and its two ways of running: :meth:`forward` over whole sequences (training:
    causal, teacher-forced), and :meth:`keys_values` + :meth:`finish` around an attention the caller
    masks (drafting token trees, :mod:`specinfer.models.head_drafter`)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.feature_norm = nn.Parameter(torch.ones(c.feature_dim))
        self.embed_norm = nn.Parameter(torch.ones(c.feature_dim))
        self.fc = nn.Linear(2 * c.feature_dim, c.hidden, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(c.hidden))
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(c.hidden))
        self.gate_up = nn.Linear(c.hidden, 2 * c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)
        self.final_norm = nn.Parameter(torch.ones(c.hidden))
        self.out = nn.Linear(c.hidden, c.feature_dim, bias=False)
        self._rope_tables: dict[tuple[torch.device, torch.dtype, bool], tuple[torch.Tensor, torch.Tensor]] = {}
        self._cpu_threads = 0  # > 0: inference runs the products on the CPU kernels (:meth:`cpu_products`)
        self._qkv: torch.Tensor | None = None  # [(heads + 2 kv_heads) head_dim, hidden] with the kernels
        self._norms: dict[int, torch.Tensor] = {}  # the norms' weights in fp32, by id, with the kernels

    def cpu_products(self, threads: int) -> bool:
        """Run the layer's products outside autograd by the CPU kernels' own (``kernels/cpu_layers.c``, on their thread
        team) with ``threads`` threads, where the kernels can read every weight (on the CPU, fp32 or bf16) and are
        built here; returns whether they do. Why: PyTorch's products (oneDNN) run on OpenMP's team, whose worker
        busy-waits after each one beside the kernels' team that runs the LLM's step, so a drafting pass (~8 small
        products) ran on one thread instead (:func:`~specinfer.models.on_device.serial_on_cpu`)."""
        from specinfer.kernels import cpu_layers, cpu_qgemm

        layers = (self.fc, self.q, self.k, self.v, self.o, self.gate_up, self.down, self.out)
        readable = all(cpu_layers.weight_kind(layer.weight.data) is not None for layer in layers)
        self._cpu_threads = threads if threads > 0 and readable and cpu_qgemm.library() is not None else 0
        # copies for inference, of the weights as they are now: q, k and v as one product (a third of the calls, each
        # output the same reduction), the norms' weights in fp32 for the kernels' norm (one call, not PyTorch's few)
        on = self._cpu_threads > 0
        self._qkv = torch.cat([self.q.weight, self.k.weight, self.v.weight]).detach().contiguous() if on else None
        norms = (self.feature_norm, self.embed_norm, self.attn_norm, self.mlp_norm, self.final_norm)
        self._norms = {id(w): w.detach().float().contiguous() for w in norms} if on else {}
        return on

    @property
    def on_cpu_kernels(self) -> bool:
        """Whether inference runs the products on the CPU kernels (:meth:`cpu_products`)."""
        return self._cpu_threads > 0

    def product(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """``layer(x)``  # [..., in] -> [..., out] in x's dtype: by the CPU kernels in inference where
        :meth:`cpu_products` set them up (each output one fp32 reduction), else by PyTorch."""
        if self._cpu_threads and not torch.is_grad_enabled():
            from specinfer.kernels import cpu_layers

            y = cpu_layers.dense_linear(x.reshape(-1, x.shape[-1]), layer.weight, self._cpu_threads)  # [N, out] fp32
            return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])
        return layer(x)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._cpu_threads and not torch.is_grad_enabled():
            from specinfer.kernels import cpu_layers

            rows = x.reshape(-1, x.shape[-1])  # [N, d]
            return cpu_layers.rms_norm_rows(rows, self._norms[id(weight)], self.config.norm_eps).view(x.shape)
        return F.rms_norm(x, weight.shape, weight, self.config.norm_eps)

    def inputs(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The layer's input of pairs: features ``f``, embeddings of the tokens after them.
        # [..., feature_dim] x2 -> [..., hidden]"""
        pairs = torch.cat([self._rms(features, self.feature_norm), self._rms(embeds, self.embed_norm)], -1)
        return self.product(self.fc, pairs)

    def keys_values(
        self, x: torch.Tensor, positions: torch.Tensor, end: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of inputs ``x``  # [N, hidden] at RoPE ``positions``  # [N] int64, each
        below ``end`` (known to the caller: reading the tensor's maximum would wait for the device).
        # [N, heads, head_dim], [N, kv_heads, head_dim], [N, kv_heads, head_dim]"""
        c = self.config
        n = x.shape[0]
        h = self._rms(x, self.attn_norm)
        if self._cpu_threads and not torch.is_grad_enabled():
            from specinfer.kernels import cpu_layers

            qkv = cpu_layers.dense_linear(h, self._qkv, self._cpu_threads).to(x.dtype)  # [N, (heads + 2 kv_heads) d]
            q, k, v = qkv.split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        else:
            q, k, v = self.product(self.q, h), self.product(self.k, h), self.product(self.v, h)
        q, k, v = q.reshape(n, c.heads, -1), k.reshape(n, c.kv_heads, -1), v.reshape(n, c.kv_heads, -1)
        cos, sin = self._rope(positions, end, x.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Predicted features from the inputs ``x``  # [N, hidden] and their attention's output
        # [N, heads, head_dim]. -> [N, feature_dim]"""
        return self.product(self.out, self.final_state(x, attended))

    def final_state(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """:meth:`finish` before its last product (``out``): the layer's final-normed state  # [N, hidden]
        (drafting folds ``out`` into the LLM's LM head for the logits)."""
        h = x + self.product(self.o, attended.flatten(-2))
        gate, up = self.product(self.gate_up, self._rms(h, self.mlp_norm)).chunk(2, dim=-1)
        h = h + self.product(self.down, F.silu(gate) * up)
        return self._rms(h, self.final_norm)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """Teacher-forced prediction over sequences: pair j = (``features[:, j]``, ``embeds[:, j]``, the
        embedding of the token after it) predicts the feature at j + 1.  # [B, S, F] x2 -> [B, S, F]"""
        b, s, _ = features.shape
        c = self.config
        x = self.inputs(features, embeds)  # [B, S, hidden]
        positions = torch.arange(s, device=x.device).repeat(b)
        q, k, v = self.keys_values(x.reshape(b * s, -1), positions, s)
        q, k, v = (t.view(b, s, -1, c.head_dim).transpose(1, 2) for t in (q, k, v))  # [B, heads, S, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=c.heads != c.kv_heads)
        return self.finish(x, attended.transpose(1, 2))  # [B, S, F]

    def _rope(self, positions: torch.Tensor, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions``  # [N], each below ``end`` -> [N, 1, head_dim] each: rows of a table kept
        per device and dtype (a drafting pass is a few rows: building them anew was a dozen small ops a pass)."""
        key = (positions.device, dtype, torch.is_inference_mode_enabled())  # an inference tensor cannot train
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] < end:
            size = max(1024, 1 << (max(end, 1) - 1).bit_length())
            table = self._rope_tables[key] = self._rope_table(size, positions.device, dtype)
        return table[0][positions], table[1][positions]

    def _rope_table(self, size: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config  # angles in fp32 whatever the head's dtype (a bf16 table would blur them)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=device) / c.head_dim))
        freqs = torch.arange(size, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [size, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [size, 1, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def is_head_dir(path: str | Path) -> bool:
    """Whether ``path`` is a draft-head checkpoint folder."""
    config = Path(path) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def save_head(head: DraftHead, path: str | Path, extra: dict | None = None, dtype: str = "float32") -> None:
    """Write ``head`` as a checkpoint folder (weights in ``dtype``: float32, float16 or bfloat16); ``extra``:
    more keys for its config.json (how it was trained, for the record)."""
    from specinfer.models.dtypes import DTYPES

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    config = {"model_type": MODEL_TYPE, **asdict(head.config), **(extra or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_head(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DraftHead:
    """A head checkpoint folder, in ``dtype`` on ``device``, ready to draft (eval mode, no gradients)."""
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{path} is not a draft head (config.json model_type {raw.get('model_type')!r})")
    config = HeadConfig(**{f.name: raw[f.name] for f in fields(HeadConfig) if f.name in raw})
    head = DraftHead(config)
    head.load_state_dict(load_file(str(path / "model.safetensors")))
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def frequent_tokens(stream: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token IDs of ``stream``  # [T] int64, most frequent first, ties (tokens the
    stream lacks among them) by lower ID: BPE vocabularies number their commoner merges first.  # [size] int64"""
    counts = torch.bincount(stream.long(), minlength=vocab_size)[:vocab_size]  # [vocab]
    order = torch.sort(-counts, stable=True).indices  # [vocab] a stable sort keeps IDs ascending within ties
    return order[: min(size, vocab_size)]


def save_draft_vocab(path: str | Path, ids: torch.Tensor) -> None:
    """Write the draft vocabulary ``ids``  # [K] into the head folder ``path``."""
    save_file({"ids": ids.to(torch.int32).contiguous()}, str(Path(path) / DRAFT_VOCAB_FILE))


def load_draft_vocab(path: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The head folder's draft vocabulary  # [K] int64, sorted ascending; None where it drafts from the whole
    vocabulary. Raises ValueError when an ID is outside ``vocab_size`` or repeated."""
    file = Path(path) / DRAFT_VOCAB_FILE
    if not file.exists():
        return None
    ids = load_file(str(file))["ids"].long().sort().values  # [K]
    if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size or bool((ids[1:] == ids[:-1]).any()):
        raise ValueError(f"{file}: token IDs must be distinct, in [0, {vocab_size})")
    return ids
