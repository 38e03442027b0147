"""Fast RAPT token privatisation on token ids (the user's local side).

Each TEXT token id is replaced by the nearest vocabulary embedding (Euclidean) of its
d_X-noised embedding [Fey20; Li23]. The noise is drawn by ``privacy.mechanisms.
dx_privatize_embeddings`` from the numpy Generator the caller passes (a secret one in
production; tests inject a seeded one); only the nearest-neighbour search runs here, in torch.

The search equals the brute-force float64 ``privacy.mechanisms.nearest_neighbor_tokens`` on the
same noisy vectors (exact ties go to the lowest id, as numpy's argmin does; two scores a real-arithmetic
tie apart may differ in float64's last bit between the two sums, which add in different orders, and
then order differently — a measure-zero event under continuous noise): a low-precision
screening product scores every vocabulary id, every id whose screening score lies within a
rigorous rounding-error bound of the row's best is kept (see :meth:`VocabularyIndex._floor`;
typically 1 to 5 ids), and those are re-scored exactly in float64. The screening runs in
bfloat16 where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX, the bound covering its
rounding; 2.6 candidates per query at η = 100 on MiniLM), otherwise in float32 (windows of 1 to 2
ids): on an AVX2-only CPU torch emulates bfloat16 products about 6x slower than float32 ones. On
CUDA (used when present, like every other model computation) the screening product runs on the GPU
in float32 with TF32 off (IEEE float32 products, so the same bound holds); the candidates come back
to the CPU for the float64 re-scoring. The product always runs at float32 matmul precision
"highest", whatever the caller set: a reduced precision would let the backend round inputs beyond
what the bound covers.

Positions that are padding or hold an excluded id (special tokens) are structure, not user text:
they are passed through unchanged, and no excluded id is ever produced.
"""

from __future__ import annotations

from collections.abc import Iterable

from contextlib import contextmanager

import numpy as np
import torch

from privacy.mechanisms import dx_privatize_embeddings

CHUNK_ROWS = 512  # queries per screening product (V × 512 scores: 62.5 MB in float32 for MiniLM; 128 to 2048 ran within 3% of each other here, 128 slower)
BLOCK_ROWS = 32  # vocabulary ids per block maximum (the vocabulary is padded to a multiple with −inf rows)
SCREEN_UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}  # u of round-to-nearest
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bfloat16 products


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively (Linux /proc/cpuinfo flags; False elsewhere)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def default_screen_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """The faster screening dtype: on a CPU bfloat16 where it is native, float32 otherwise; on
    CUDA float32 (TF32 off), which the GPU multiplies fast enough."""
    if torch.device(device).type != "cpu":
        return torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@contextmanager
def ieee_float32_products():
    """float32 matmul precision "highest" inside (no TF32 on CUDA, no bfloat16 passes in oneDNN),
    and on CUDA no reduced-precision reductions in bfloat16 products: the screening bound assumes
    inputs rounded only to the screening dtype and sums in float32."""
    before = torch.get_float32_matmul_precision()
    cuda_matmul = torch.backends.cuda.matmul
    bf16_reduction = cuda_matmul.allow_bf16_reduced_precision_reduction
    torch.set_float32_matmul_precision("highest")
    cuda_matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
        cuda_matmul.allow_bf16_reduced_precision_reduction = bf16_reduction


def _checked_embeddings(embeddings) -> torch.Tensor:
    """The vocabulary's embeddings as a CPU tensor: a non-empty, finite (V, d) matrix."""
    emb = embeddings.detach().cpu() if isinstance(embeddings, torch.Tensor) else torch.as_tensor(np.asarray(embeddings))
    if emb.dim() != 2 or emb.shape[0] == 0 or emb.shape[1] == 0:
        raise ValueError(f"embeddings must be a non-empty (V, d) matrix, got shape {tuple(emb.shape)}")
    if not torch.isfinite(emb).all():
        raise ValueError("embeddings must be finite")
    return emb


def _excluded_ids(exclude_ids: Iterable[int] | None, V: int) -> torch.Tensor:
    """The excluded token ids, sorted: each in [0, V), at least one token left."""
    excluded = sorted({int(i) for i in (exclude_ids or [])})
    if excluded and (excluded[0] < 0 or excluded[-1] >= V):
        raise ValueError(f"exclude_ids must lie in [0, {V}), got ids from {excluded[0]} to {excluded[-1]}")
    if len(excluded) >= V:
        raise ValueError("exclude_ids must leave at least one vocabulary token")
    return torch.tensor(excluded, dtype=torch.long)


# How the screening product is laid out, and what was measured against it:
# The product is [v, −½‖v‖²] (V, d+1) times [q, 1]ᵀ (in float32 an addmm of the last column and
# the (V, d) vocabulary times qᵀ) into one (V, chunk) buffer reused across chunks: on a 2-core
# AVX2 machine that ran at about 7,500 queries/s on MiniLM against about 4,100–4,400 for the
# (chunk, V) product of d + 1 columns into fresh memory it replaced. The candidates come from the
# maxima of blocks of ``BLOCK_ROWS`` ids (one pass over the scores; the vocabulary is padded to whole
# blocks with rows that score −inf): only blocks whose maximum passes a query's floor are compared id
# by id. Comparing all V × chunk scores against the floor and taking ``nonzero`` of that mask cost
# 13.5 ms of 46 per 512 queries in bfloat16 on a 2-core AVX512-BF16 machine, as long as half the
# product (28.5 ms); the block maxima made the bfloat16 search 1.35–1.50x faster there (≈ 14,000
# queries/s) and float32 0.98–1.21x. Measured and rejected on the AVX2 machine: an 8-bit integer
# screening product (oneDNN's quantized linear kernel, 1.8x the float32 product there). Without VNNI
# its u8·s8 pairs saturate int16 unless the queries keep 7 bits, and then the rigorous rounding bound
# keeps about 3,500 of 30,522 MiniLM ids per query at η = 100 (median; 16 at η = 150, 11,940 at
# η = 50) for re-scoring.
class VocabularyIndex:
    """A (V, d) vocabulary prepared once for repeated nearest-neighbour searches: a float64 copy,
    ‖v‖² penalties (+inf for excluded ids), and the screening matrix [v, −½‖v‖²] in
    ``screen_dtype`` (None: :func:`default_screen_dtype`) with the norms its error bound needs, on
    ``device`` (None: CUDA when present, else the CPU) for the screening product."""

    def __init__(self, embeddings, exclude_ids: Iterable[int] | None = None, screen_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        emb = _checked_embeddings(embeddings)
        self.vocab64 = emb.to(torch.float64).contiguous()
        from models.device import resolve_device

        self.device = resolve_device(device)
        if screen_dtype is None:
            screen_dtype = default_screen_dtype(self.device)
        if screen_dtype not in SCREEN_UNIT_ROUNDOFF:
            raise ValueError(f"screen_dtype must be one of {list(SCREEN_UNIT_ROUNDOFF)}, got {screen_dtype}")
        self.screen_dtype = screen_dtype
        self.unit_roundoff = SCREEN_UNIT_ROUNDOFF[screen_dtype]
        self.accumulation_error = (emb.shape[1] + 1) * 2.0 ** -23  # float32 sums of d+1 products
        V = emb.shape[0]
        self.excluded = _excluded_ids(exclude_ids, V)
        pen64 = (self.vocab64 ** 2).sum(1)
        pen64[self.excluded] = float("inf")
        self.penalty64 = pen64
        kept = torch.ones(V, dtype=torch.bool)
        kept[self.excluded] = False
        self._prepare_screening(kept)

    def _prepare_screening(self, kept: torch.Tensor) -> None:
        """The screening matrix [v, −½‖v‖²] in ``screen_dtype`` (excluded and padding rows masked),
        on the device, and the norms its error bound needs (over the ``kept`` ids)."""
        V, screen_dtype = self.vocab64.shape[0], self.screen_dtype
        half_pen = -0.5 * (self.vocab64 ** 2).sum(1)
        # excluded ids screen as zero rows whose scores are then set to −inf after every product, so
        # they never set a row's best score nor pass its floor (a finite penalty could, for queries
        # of norm ~1e6 and beyond, and then an excluded id came out). Not −inf inside the product:
        # oneDNN's AVX-512 bfloat16 kernels (no native bf16) multiply a −inf by a zero padding lane
        # and return NaN for the whole row, and a NaN maximum let no candidate pass.
        half_pen[self.excluded] = 0.0
        augmented = torch.cat([self.vocab64, half_pen.unsqueeze(1)], 1)
        augmented[self.excluded, :-1] = 0.0
        # padded with screening-only rows like the excluded ones to whole blocks of BLOCK_ROWS ids
        pad = -V % BLOCK_ROWS
        padding = torch.zeros((pad, augmented.shape[1]), dtype=torch.float64)
        self.masked_rows = torch.cat([self.excluded, torch.arange(V, V + pad, dtype=torch.long)])
        screen = torch.cat([augmented, padding]).to(screen_dtype)
        # the product's operands. float32: the vocabulary (V, d) and −½‖v‖² as the bias column an
        # addmm adds within its float32 sums (d = 384 runs about 1.1x faster than d + 1 = 385 here).
        # bfloat16: the augmented (V, d+1) rows in one mm, so that −½‖v‖² joins the float32 sum
        # before the one rounding to bfloat16 (an addmm may round V·qᵀ to bfloat16 before adding it)
        if screen_dtype == torch.float32:
            self.screen_vocab = screen[:, :-1].contiguous().to(self.device)
            self.screen_bias = screen[:, -1:].contiguous().to(self.device)
        else:
            self.screen_vocab, self.screen_bias = screen.contiguous().to(self.device), None
        if not bool(torch.isfinite(screen[:V][kept]).all()):
            raise ValueError(f"embeddings too large for {str(screen_dtype).removeprefix('torch.')} screening "
                             f"(½‖v‖² overflows it; the largest norm is {float(self.vocab64[kept].norm(dim=1).max()):.3g})")
        rounded = screen[:V].to(torch.float64)
        # for the error bound, over the kept ids (excluded and padding rows score −inf):
        self.max_augmented_norm = float(augmented[kept].norm(dim=1).max())  # max ‖a‖
        self.max_rounded_norm = float(rounded[kept].norm(dim=1).max())  # max ‖ã‖
        self.max_rounding_norm = float((augmented - rounded)[kept].norm(dim=1).max())  # max ‖a − ã‖
        # the largest ‖[q, 1]‖ the screening scores exactly: |out| ≤ (1 + γ)‖b̃‖‖ã‖ then stays under a
        # fifth of the dtype's range, so neither the scores nor the bound's terms overflow
        self.max_query_norm = float(torch.finfo(screen_dtype).max) / (5.0 * max(self.max_rounded_norm, 1.0))

    @property
    def size(self) -> int:
        return int(self.vocab64.shape[0])

    @property
    def dim(self) -> int:
        return int(self.vocab64.shape[1])

    def nearest(self, queries) -> np.ndarray:
        """Exact (float64-equal) nearest non-excluded vocabulary id of every row of ``queries``
        (..., d); among exactly tied ids the lowest, as numpy's argmin picks."""
        q = queries.detach().cpu() if isinstance(queries, torch.Tensor) else torch.as_tensor(np.asarray(queries))
        if q.dim() == 0 or q.shape[-1] != self.dim:
            raise ValueError(f"queries must have last dimension {self.dim}, got shape {tuple(q.shape)}")
        flat64 = q.reshape(-1, self.dim).to(torch.float64)
        if not bool(torch.isfinite(flat64).all()):
            raise ValueError("queries must be finite (a NaN or infinite noisy embedding)")
        largest = float(flat64.norm(dim=1).max()) if flat64.shape[0] else 0.0
        if largest + 1.0 >= self.max_query_norm:
            raise ValueError(f"a query's norm {largest:.3g} is beyond what the "
                             f"{str(self.screen_dtype).removeprefix('torch.')} screening scores exactly "
                             f"({self.max_query_norm:.3g}); for d_X noise (norm ≈ d/η) η is far too small")
        out = torch.empty(flat64.shape[0], dtype=torch.long)
        # one (V, chunk) score buffer for all chunks of this call: a product into fresh memory pays
        # its page faults every time (about 1.3x slower on the AVX2 machine)
        rows = min(CHUNK_ROWS, flat64.shape[0])
        scores = torch.empty((self.screen_vocab.shape[0], rows), dtype=self.screen_dtype, device=self.device)
        for s in range(0, flat64.shape[0], CHUNK_ROWS):
            chunk = flat64[s:s + CHUNK_ROWS]
            n = chunk.shape[0]
            found = self._nearest_chunk(chunk, scores[:, :n])
            if found.shape[0] != n:  # every row's best kept id passes its own floor
                raise RuntimeError(f"the screening kept no candidate for {n - found.shape[0]} of {n} queries")
            out[s:s + n] = found
        return out.reshape(q.shape[:-1]).numpy()

    def _floor(self, q64: torch.Tensor, q_screen: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """Per query, a screening score below which no id can be the nearest.

        With b = [q, 1], a_j = [v_j, −½‖v_j‖²] and their roundings b̃, ã_j, the exact score is
        b·a_j = b̃·ã_j + b̃·(a_j − ã_j) + (b − b̃)·a_j, and the screening output is b̃·ã_j summed in
        float32 (error ≤ γ‖b̃‖‖ã_j‖, γ = (d+1)·2⁻²³, for any order of the d+1 additions: the
        float32 addmm adds −½‖v_j‖² as one of them), then rounded to the screening dtype (≤ u′|out|).
        So |b·a_j − out_j| ≤ e_j = u′|out_j| + C with C = ‖b̃‖·max‖a − ã‖ + ‖b − b̃‖·max‖a‖ +
        γ‖b̃‖·max‖ã‖. The winner scores ≥ L = top − e_top; id j can reach L only if
        out_j + e_j ≥ L, i.e. out_j ≥ (L − C)/(1 ± u′). Both u′ and C carry a 25% margin.
        """
        ones = torch.ones((q64.shape[0], 1), dtype=torch.float64)
        b, qa64 = torch.cat([q64, ones], 1), torch.cat([q_screen.to(torch.float64), ones], 1)
        bn, dbn = qa64.norm(dim=1), (b - qa64).norm(dim=1)
        u = 1.25 * self.unit_roundoff / (1.0 - self.unit_roundoff)
        c = 1.25 * (bn * self.max_rounding_norm + dbn * self.max_augmented_norm
                    + self.accumulation_error * bn * self.max_rounded_norm) + 1e-12
        low = top - u * top.abs() - c - c  # L − C
        return torch.where(low >= 0, low / (1.0 + u), low / (1.0 - u))

    def _nearest_chunk(self, q64: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # screening score q·v − ½‖v‖² (to maximise; ‖q‖² is constant per query) as ONE low-precision
        # product [v, −½‖v‖²]·[q, 1]ᵀ into ``scores`` (V padded to whole blocks, n); this orientation
        # runs about 1.35x faster than (n, V) on the 2-core AVX2 machine
        q_screen = q64.to(self.screen_dtype)
        with ieee_float32_products():
            if self.screen_bias is not None:
                torch.addmm(self.screen_bias, self.screen_vocab, q_screen.to(self.device).T, out=scores)
            else:
                ones = torch.ones((q64.shape[0], 1), dtype=self.screen_dtype)
                torch.mm(self.screen_vocab, torch.cat([q_screen, ones], 1).to(self.device).T, out=scores)
        if self.masked_rows.numel():
            scores[self.masked_rows.to(scores.device)] = float("-inf")
        # the maximum of every block of BLOCK_ROWS ids per query: ONE pass over the scores gives the
        # row's best (their maximum) and the blocks that can hold a candidate (an id passes the
        # floor only if its block's maximum does); only those blocks are compared id by id
        blocks = scores.unflatten(0, (-1, BLOCK_ROWS))  # (V / B, B, n), a view
        block_max = blocks.amax(dim=1)
        top = block_max.amax(dim=0)
        floor = self._floor(q64, q_screen, top.to(device="cpu", dtype=torch.float64))
        # compare in the screening dtype, the floor lowered by two of its units in the last place
        # first so that rounding it cannot lose a candidate
        low = (floor - floor.abs() * 4.0 * self.unit_roundoff - 1e-30).to(self.screen_dtype).to(self.device)
        block_ids, block_rows = (block_max >= low.unsqueeze(0)).nonzero(as_tuple=True)
        hit_pairs, offsets = (blocks[block_ids, :, block_rows] >= low[block_rows].unsqueeze(1)).nonzero(as_tuple=True)
        cols = (block_ids[hit_pairs] * BLOCK_ROWS + offsets).cpu()
        rows = block_rows[hit_pairs].cpu()
        exact = self.penalty64[cols] - 2.0 * (q64[rows] * self.vocab64[cols]).sum(1)
        order = np.lexsort((cols.numpy(), exact.numpy(), rows.numpy()))  # by row, then score, then id
        rows_sorted = rows.numpy()[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = rows_sorted[1:] != rows_sorted[:-1]
        return torch.from_numpy(cols.numpy()[order][first])


def privatize_ids(ids, attention_mask, embeddings, eta: float, rng: np.random.Generator,
                  exclude_ids: Iterable[int] | None = None, index: VocabularyIndex | None = None,
                  positions=None):
    """d_X-privatise the text tokens of ``ids`` (N, L): each position with attention 1 whose id is
    not in ``exclude_ids`` becomes the nearest vocabulary id (never an excluded one) of its noised
    embedding; padding and excluded ids pass through. ``positions`` (a boolean mask within the
    attention mask), when given, names the positions to privatise instead — whatever their id, so
    a special id inside the text (``[UNK]``, a literal ``[MASK]``) is privatised too. Noise:
    ``privacy.mechanisms.dx_privatize_embeddings`` with ``rng`` (the caller passes a secret
    generator). ``index`` (a :class:`VocabularyIndex` of the same embeddings and exclusions) skips
    the preparation when privatising many batches. Returns a LongTensor like ``ids``."""
    ids_t = torch.as_tensor(ids)
    if ids_t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"ids must be integer token ids, got dtype {ids_t.dtype}")
    ids_t = ids_t.to(torch.long)
    mask = torch.ones_like(ids_t, dtype=torch.bool) if attention_mask is None else torch.as_tensor(attention_mask).bool()
    if mask.shape != ids_t.shape:
        raise ValueError(f"attention_mask must have the shape of ids {tuple(ids_t.shape)}, got {tuple(mask.shape)}")
    if index is None:
        index = VocabularyIndex(embeddings, exclude_ids)
    elif exclude_ids is not None and {int(i) for i in exclude_ids} != set(index.excluded.tolist()):
        raise ValueError("exclude_ids differ from the exclusions the given index was built with")
    if mask.any() and int(ids_t[mask].min()) < 0:
        raise ValueError("ids must be non-negative token ids")
    if positions is None:
        text = mask & ~torch.isin(ids_t, index.excluded)
    else:
        text = torch.as_tensor(positions).bool()
        if text.shape != ids_t.shape or bool((text & ~mask).any()):
            raise ValueError("positions must be a boolean mask of the shape of ids, within the attention mask")
    if text.any() and int(ids_t[text].max()) >= index.size:
        raise ValueError(f"ids must lie in [0, {index.size}) (the vocabulary size)")
    out = ids_t.clone()
    picked = ids_t[text]
    if picked.numel():
        noisy = dx_privatize_embeddings(index.vocab64[picked].numpy(), eta, rng)
        out[text] = torch.from_numpy(index.nearest(noisy))
    return out


def text_token_mask(ids, attention_mask, exclude_ids: Iterable[int]) -> torch.Tensor:
    """Positions that :func:`privatize_ids` privatises: attended and not an excluded id."""
    ids_t = torch.as_tensor(ids).long()
    mask = torch.as_tensor(attention_mask).bool()
    return mask & ~torch.isin(ids_t, torch.tensor(sorted({int(i) for i in exclude_ids}), dtype=torch.long))


def changed_share(original, privatized, positions) -> float:
    """Share of the ``positions`` (a boolean mask) whose id differs between ``original`` and
    ``privatized`` (RAPT's replacement probability, Table 4). It reads the original ids: on
    private text an audit statistic, not a DP output."""
    orig, priv = torch.as_tensor(original).long(), torch.as_tensor(privatized).long()
    pos = torch.as_tensor(positions).bool()
    if not (orig.shape == priv.shape == pos.shape):
        raise ValueError(f"original {tuple(orig.shape)}, privatized {tuple(priv.shape)} and positions "
                         f"{tuple(pos.shape)} must have one shape")
    n = int(pos.sum())
    if n == 0:
        raise ValueError("no text tokens: the replacement probability is undefined")
    return float((orig[pos] != priv[pos]).sum()) / n


def replace_probability(original, privatized, attention_mask, exclude_ids: Iterable[int]) -> float:
    """Share of text tokens (see :func:`text_token_mask`) whose id changed (RAPT's Table 4)."""
    return changed_share(original, privatized, text_token_mask(original, attention_mask, exclude_ids))


class BackbonePrivatizer:
    """Privatiser for the ids of a backbone's own tokenizer: its input embeddings are the
    vocabulary, its special ids are excluded (``load_backbone('minilm')`` by default)."""

    def __init__(self, backbone=None, exclude_ids: Iterable[int] | None = None, device=None):
        if backbone is None:
            from models.backbones import load_backbone

            backbone = load_backbone("minilm", device="cpu")
        self.backbone = backbone
        special = set(getattr(backbone.tokenizer, "all_special_ids", []) or [])
        self.exclude_ids = sorted(special | {int(i) for i in (exclude_ids or [])})
        self.index = VocabularyIndex(backbone.input_embeddings().weight, self.exclude_ids, device=device)

    def __call__(self, ids, attention_mask, eta: float, rng: np.random.Generator, positions=None) -> torch.Tensor:
        return privatize_ids(ids, attention_mask, None, eta, rng, index=self.index, positions=positions)

    def replace_probability(self, original, privatized, attention_mask) -> float:
        return replace_probability(original, privatized, attention_mask, self.exclude_ids)
