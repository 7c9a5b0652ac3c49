"""Philox4x32-10: Random123 known answers, Triton == torch reference, the contract's index mapping."""

import pytest
import torch
import triton
import triton.language as tl
from det_core import rng
from det_core.testing import assert_bitwise_equal

# Random123 kat_vectors: philox4x32 10 rounds (counter words, key words, expected output words)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@triton.jit
def _philox_kernel(c_ptr, k_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < N
    c0 = tl.load(c_ptr + offs * 4 + 0, mask=m).to(tl.uint32)
    c1 = tl.load(c_ptr + offs * 4 + 1, mask=m).to(tl.uint32)
    c2 = tl.load(c_ptr + offs * 4 + 2, mask=m).to(tl.uint32)
    c3 = tl.load(c_ptr + offs * 4 + 3, mask=m).to(tl.uint32)
    k0 = tl.load(k_ptr + offs * 2 + 0, mask=m).to(tl.uint32)
    k1 = tl.load(k_ptr + offs * 2 + 1, mask=m).to(tl.uint32)
    r0, r1, r2, r3 = rng.philox4x32_10(c0, c1, c2, c3, k0, k1)
    tl.store(out_ptr + offs * 4 + 0, r0.to(tl.int64), mask=m)
    tl.store(out_ptr + offs * 4 + 1, r1.to(tl.int64), mask=m)
    tl.store(out_ptr + offs * 4 + 2, r2.to(tl.int64), mask=m)
    tl.store(out_ptr + offs * 4 + 3, r3.to(tl.int64), mask=m)


@triton.jit
def _bits_kernel(idx_ptr, out_ptr, N, seed_lo, seed_hi, step, stream, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    idx = tl.load(idx_ptr + offs, mask=m, other=0)
    tl.store(out_ptr + offs, rng.random_bits(seed_lo, seed_hi, step, stream, idx).to(tl.int64), mask=m)


@triton.jit
def _bits_x4_kernel(out_ptr, base, seed_lo, seed_hi, step, stream, BLOCK: tl.constexpr):
    start = base + tl.program_id(0).to(tl.int64) * BLOCK
    r = rng.random_bits_x4(seed_lo, seed_hi, step, stream, start, BLOCK)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, r.to(tl.int64))


def _triton_bits(index, seed, step, stream, device):
    out = torch.empty_like(index, device=device)
    lo, hi = rng.split_seed(seed)
    n = index.numel()
    _bits_kernel[(triton.cdiv(n, 128),)](index.to(device), out, n, lo, hi, step, stream, BLOCK=128)
    return out.cpu()


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_known_answers_torch(counter, key, expected):
    c = [torch.tensor([w], dtype=torch.int64) for w in counter]
    out = rng.philox4x32_10_torch(*c, *key)
    assert tuple(int(o) for o in out) == expected


def _kernel_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_known_answers_triton():
    device = _kernel_device()
    c = torch.tensor([kat[0] for kat in KNOWN_ANSWERS], dtype=torch.int64, device=device)
    k = torch.tensor([kat[1] for kat in KNOWN_ANSWERS], dtype=torch.int64, device=device)
    out = torch.empty(len(KNOWN_ANSWERS), 4, dtype=torch.int64, device=device)
    _philox_kernel[(1,)](c, k, out, len(KNOWN_ANSWERS), BLOCK=4)
    assert [tuple(row) for row in out.cpu().tolist()] == [kat[2] for kat in KNOWN_ANSWERS]


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**64 - 1])
@pytest.mark.parametrize("step,stream", [(0, 0), (1, 1), (2**32 - 1, 7)])
def test_triton_matches_torch_reference(seed, step, stream):
    index = torch.cat(
        [torch.arange(0, 300), torch.tensor([2**31 - 1, 2**31, 2**32 + 5, 2**40 + 3, 2**62 + 1])]
    )
    expected = rng.random_bits_torch(seed, step, stream, index)
    assert_bitwise_equal(_triton_bits(index, seed, step, stream, _kernel_device()), expected, "bits")


def test_x4_form_equals_per_element_form():
    base = 2**33 + 16  # a global index past 2**32, 4-aligned
    out = torch.empty(256, dtype=torch.int64, device=_kernel_device())
    lo, hi = rng.split_seed(99)
    _bits_x4_kernel[(2,)](out, base, lo, hi, 3, 0, BLOCK=128)
    expected = rng.random_bits_torch(99, 3, 0, torch.arange(base, base + 256))
    assert_bitwise_equal(out.cpu(), expected, "x4 bits")


def test_contract_mapping_is_word_of_counter_quarter():
    # element i uses word i & 3 of philox((i >> 2) lo, (i >> 2) hi, step, stream; seed lo, seed hi)
    seed, step, stream = 0x1234_5678_9ABC_DEF0, 17, 2
    i = 2**35 + 6
    q = i >> 2
    words = rng.philox4x32_10_torch(
        *(torch.tensor([w]) for w in (q & 0xFFFFFFFF, q >> 32, step, stream)), seed & 0xFFFFFFFF, seed >> 32
    )
    assert int(rng.random_bits_torch(seed, step, stream, torch.tensor([i]))) == int(words[i & 3])


def test_bits_depend_on_every_key_part():
    index = torch.arange(4096)
    base = rng.random_bits_torch(0, 0, 0, index)
    for seed, step, stream in [(1, 0, 0), (0, 1, 0), (0, 0, 1), (2**32, 0, 0)]:
        other = rng.random_bits_torch(seed, step, stream, index)
        assert (other != base).float().mean() > 0.99
    # roughly uniform: each of the 32 bits set about half the time
    ones = torch.stack([(base >> b) & 1 for b in range(32)]).float().mean(dim=1)
    assert bool(((ones - 0.5).abs() < 0.04).all()), ones


@pytest.mark.parametrize("bad", [dict(seed=-1), dict(seed=2**64), dict(step=2**32), dict(stream=-1)])
def test_out_of_range_key_is_rejected(bad):
    args = dict(seed=0, step=0, stream=0) | bad
    with pytest.raises(ValueError):
        rng.random_bits_torch(args["seed"], args["step"], args["stream"], torch.arange(4))


@pytest.mark.parametrize(
    "key, index",
    [
        (dict(seed=True), torch.arange(2)),
        (dict(seed=1.0), torch.arange(2)),
        (dict(step=2.5), torch.arange(2)),
        (dict(stream="0"), torch.arange(2)),
        ({}, torch.tensor([1.5])),
        ({}, torch.tensor([True])),
        ({}, [0, 1]),
    ],
)
def test_a_key_or_index_that_is_not_an_integer_is_refused_not_truncated(key, index):
    """A bool seed was read as 1, a float as its integer part, a float index 1.5 as 1: each would
    silently name other random bits."""
    args = dict(seed=0, step=0, stream=0) | key
    with pytest.raises(TypeError, match="must be an integer"):
        rng.random_bits_torch(args["seed"], args["step"], args["stream"], index)


@pytest.mark.gpu
def test_tensor_past_2_pow_31_elements_on_gpu():
    n = 2**31 + 1024
    out = torch.empty(n, dtype=torch.int32, device="cuda")
    _store_bits_kernel[(triton.cdiv(n, 1024),)](out, n, 5, 0, 1, 0, BLOCK=1024)
    tail = torch.arange(n - 1024, n)
    expected = rng.random_bits_torch(5, 1, 0, tail)
    got = out[n - 1024 :].cpu().to(torch.int64) & 0xFFFFFFFF
    assert_bitwise_equal(got, expected, "bits past 2**31")


@triton.jit
def _store_bits_kernel(out_ptr, N, seed_lo, seed_hi, step, stream, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    r = rng.random_bits(seed_lo, seed_hi, step, stream, offs)
    tl.store(out_ptr + offs, r.to(tl.int32, bitcast=True), mask=m)
