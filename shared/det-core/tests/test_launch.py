"""det_core.launch: ``launch`` and ``BoundLaunch`` give ``kernel[grid]``'s results, key what Triton
3.6 specializes on, and launch the compiled kernel's C launcher as Triton's launcher would."""

from __future__ import annotations

import gc
import types
import weakref

import det_core.launch as det_launch
import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _axpb_kernel(x_ptr, out_ptr, n, a, b, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    y = x * a + b
    if SQUARE:
        y = y * y
    tl.store(out_ptr + offs, y, mask=offs < n)


def _launch_cases(device):
    base = torch.randn(4096 + 8, device=device)
    for offset in (0, 1, 4):  # 16-byte aligned and not
        for n in (1, 16, 17, 1000):  # Triton specializes ints equal to 1 and divisible by 16
            for square in (False, True):
                yield base[offset : offset + n], n, square


def test_launch_equals_the_jit_path_on_cpu():
    # under the interpreter launch() is kernel[grid](...) itself
    for x, n, square in _launch_cases("cpu"):
        want, got = torch.empty_like(x), torch.empty_like(x)
        grid = (triton.cdiv(n, 64),)
        _axpb_kernel[grid](x, want, n, 1.5, 2, BLOCK=64, SQUARE=square)
        det_launch.launch(_axpb_kernel, grid, x, got, n, 1.5, 2, BLOCK=64, SQUARE=square)
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_direct_launch_equals_the_jit_path():
    """Second and later launches of a key go through the compiled kernel's run (Triton 3.6): same
    outputs as kernel[grid] for aligned and unaligned pointers, specialized and plain ints,
    defaulted and passed constexprs."""
    for _ in range(2):  # the first round fills the cache, the second launches directly
        for x, n, square in _launch_cases("cuda"):
            want, got = torch.empty_like(x), torch.empty_like(x)
            grid = (triton.cdiv(n, 64),)
            _axpb_kernel[grid](x, want, n, 1.5, 2, BLOCK=64, SQUARE=square)
            if square:
                det_launch.launch(_axpb_kernel, grid, x, got, n, 1.5, 2, BLOCK=64, SQUARE=True)
            else:  # the constexpr default fills the tail
                det_launch.launch(_axpb_kernel, grid, x, got, n, 1.5, 2, BLOCK=64)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (x.data_ptr() % 16, n, square)
    if det_launch._direct_launch_enabled():
        assert any(key[0] == id(_axpb_kernel) for key in det_launch._LAUNCHES)  # keys name kernels by id


class _FakeParam:
    def __init__(self, name, constexpr=False, specialize=True):
        self.name, self.is_constexpr, self.do_not_specialize = name, constexpr, not specialize


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, kernel, tag):
        self.kernel, self.tag = kernel, tag

    def run(self, *launch):
        self.kernel.direct.append((self.tag, launch[9:]))


class _FakeKernel:
    """Stands in for a JITFunction: ``kernel[grid](...)`` records a slow-path launch and returns
    a compiled kernel whose ``run`` records the direct launches with their arguments."""

    def __init__(self):
        import inspect

        def fn(x, n, m, scale, SCALE=2, FLAG=False):
            pass

        self.signature = inspect.signature(fn)
        self.params = [_FakeParam("x"), _FakeParam("n"), _FakeParam("m", specialize=False),
                       _FakeParam("scale"), _FakeParam("SCALE", True), _FakeParam("FLAG", True)]  # fmt: skip
        self.used_global_vals, self.pre_run_hooks = {}, []
        self.slow, self.direct = [], []

    def __hash__(self):
        return id(self)

    def __getitem__(self, grid):
        def runner(*args, **kwargs):
            self.slow.append((args, kwargs))
            return _FakeCompiled(self, len(self.slow))

        return runner


@pytest.fixture
def direct_launch(monkeypatch):
    import types

    knobs = types.SimpleNamespace(
        runtime=types.SimpleNamespace(debug=False, launch_enter_hook=None, launch_exit_hook=None),
        compilation=types.SimpleNamespace(instrumentation_mode=""),
    )
    monkeypatch.setattr(det_launch, "_direct_launch", True)
    monkeypatch.setattr(det_launch, "_knobs", knobs)
    monkeypatch.setattr(det_launch, "_LAUNCHES", det_launch.collections.OrderedDict())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    return knobs


def test_launch_key_follows_triton_36_specialization(direct_launch):
    k = _FakeKernel()
    x = torch.zeros(64)
    det_launch.launch(k, (1,), x, 32, 5, 1.5)  # first of its key: Triton's path
    assert len(k.slow) == 1 and not k.direct
    y = torch.zeros(64)
    det_launch.launch(k, (1,), y, 32, 1000, -0.0)  # same key: direct, with the live arguments
    assert len(k.slow) == 1 and k.direct[-1] == (1, (y, 32, 1000, -0.0, 2, False))
    det_launch.launch(k, (1,), y, 1, 5, 1.5)  # n == 1 is a constexpr in Triton 3.6: another kernel
    det_launch.launch(k, (1,), y, 48, 5, 1.5)  # ints that Triton specializes on: keyed exactly
    det_launch.launch(k, (1,), y, 2**31, 5, 1.5)  # i64: another kernel
    det_launch.launch(k, (1,), x[1:], 32, 5, 1.5)  # an unaligned pointer: another kernel
    det_launch.launch(k, (1,), y.double(), 32, 5, 1.5)  # another dtype: another kernel
    det_launch.launch(k, (1,), y, 32, 2**40, 1.5)  # m is do_not_specialize: i64 is another kernel
    assert len(k.slow) == 7
    det_launch.launch(k, (1,), y, 32, 1, 2.5)  # m is do_not_specialize: its i32 value does not matter
    assert len(k.slow) == 7 and k.direct[-1] == (1, (y, 32, 1, 2.5, 2, False))


def test_launch_keys_keyword_values_by_type_and_bits(direct_launch):
    k = _FakeKernel()
    x = torch.zeros(64)
    det_launch.launch(k, (1,), x, 32, 5, 1.5, SCALE=2)
    det_launch.launch(k, (1,), x, 32, 5, 1.5, SCALE=2.0)  # equal to 2, another constexpr
    det_launch.launch(k, (1,), x, 32, 5, 1.5, SCALE=0.0)
    det_launch.launch(k, (1,), x, 32, 5, 1.5, SCALE=-0.0)  # equal to 0.0, other bits
    det_launch.launch(k, (1,), x, 32, 5, 1.5, FLAG=1)
    det_launch.launch(k, (1,), x, 32, 5, 1.5, FLAG=True)  # equal to 1, another type
    assert len(k.slow) == 6 and not k.direct
    det_launch.launch(k, (1,), x, 32, 5, 1.5, SCALE=-0.0)
    assert k.direct[-1] == (4, (x, 32, 5, 1.5, -0.0, False))
    direct_launch.runtime.launch_enter_hook = lambda meta: None  # a hook: Triton's path again
    det_launch.launch(k, (1,), x, 32, 5, 1.5, SCALE=-0.0)
    assert len(k.slow) == 7


def test_launch_keeps_the_tail_of_plain_keywords_only(direct_launch):
    """Plain keyword values (ints, bools, strs, None) are keyed exactly, so their tail is kept with
    the compiled kernel; a tensor passed by keyword is keyed by dtype and alignment only, so the
    direct launch must pass the live tensor, never the one of the first launch."""
    k = _FakeKernel()
    x = torch.zeros(64)
    det_launch.launch(k, (1,), x, 32, 5, 1.5, FLAG=True)
    det_launch.launch(k, (1,), x, 32, 5, 1.5, FLAG=True)
    assert len(k.slow) == 1 and k.direct[-1] == (1, (x, 32, 5, 1.5, 2, True))
    det_launch.launch(k, (1,), x, 32, 5, 1.5, FLAG=False)  # another value: another kernel
    assert len(k.slow) == 2
    s1, s2 = torch.zeros(4), torch.ones(4)
    det_launch.launch(k, (1,), x, 32, 5, scale=s1)
    det_launch.launch(k, (1,), x, 32, 5, scale=s2)  # same key (dtype, alignment): the live tensor goes
    assert len(k.slow) == 3 and k.direct[-1][0] == 3 and k.direct[-1][1][3] is s2


def test_bound_launch_keys_only_its_leading_arguments(direct_launch):
    """A BoundLaunch passes (leading, trailing, tail) as launch() would; a new leading key (another
    alignment or dtype) or a hook takes Triton's path; the first call of each key too."""
    k = _FakeKernel()
    bound = det_launch.BoundLaunch(k, 1, (32, 5, 1.5), FLAG=True)
    x, y = torch.zeros(64), torch.zeros(64)
    bound((1,), x)  # first of its key: Triton's path, all arguments
    assert k.slow == [((x, 32, 5, 1.5), {"FLAG": True})] and not k.direct
    bound((1,), y)  # same key: direct, live leading argument, bound ones, the defaulted SCALE
    assert len(k.slow) == 1 and k.direct[-1] == (1, (y, 32, 5, 1.5, 2, True))
    bound((1,), x[1:])  # unaligned: another kernel
    bound((1,), y.double())  # another dtype: another kernel
    assert len(k.slow) == 3
    direct_launch.runtime.launch_enter_hook = lambda meta: None  # a hook: Triton's path again
    bound((1,), y)
    assert len(k.slow) == 4
    direct_launch.runtime.launch_enter_hook = types.SimpleNamespace(calls=[])  # an empty HookChain
    bound((1,), y)
    assert len(k.slow) == 4 and len(k.direct) == 2
    for hooked in ("exit", "pre_run"):  # the exit hook and a pre-run hook each take Triton's path
        if hooked == "exit":
            direct_launch.runtime.launch_exit_hook = types.SimpleNamespace(calls=[print])
        else:
            direct_launch.runtime.launch_exit_hook, k.pre_run_hooks = None, [print]
        bound((1,), y)
        assert len(k.slow) == (5 if hooked == "exit" else 6) and len(k.direct) == 2


def test_bound_launch_is_the_jit_path_off_the_direct_path_and_refuses_tensors(monkeypatch):
    k = _FakeKernel()
    monkeypatch.setattr(det_launch, "_direct_launch", False)
    x = torch.zeros(64)
    det_launch.BoundLaunch(k, 1, (32, 5), scale=1.5)((1,), x)
    assert k.slow == [((x, 32, 5), {"scale": 1.5})]
    with pytest.raises(TypeError, match="pass tensors as leading arguments"):
        det_launch.BoundLaunch(k, 1, (torch.zeros(2), 5))
    with pytest.raises(TypeError, match="pass tensors as leading arguments"):
        det_launch.BoundLaunch(k, 3, (), scale=torch.zeros(1))


def test_bound_launch_equals_the_jit_path_on_cpu():
    for x, n, square in _launch_cases("cpu"):
        want, got = torch.empty_like(x), torch.empty_like(x)
        grid = (triton.cdiv(n, 64),)
        _axpb_kernel[grid](x, want, n, 1.5, 2, BLOCK=64, SQUARE=square)
        det_launch.BoundLaunch(_axpb_kernel, 2, (n, 1.5, 2), BLOCK=64, SQUARE=square)(grid, x, got)
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_bound_launch_equals_the_jit_path():
    """BoundLaunch's direct launches (second round) give kernel[grid]'s outputs."""
    bound = {}
    for _ in range(2):
        for x, n, square in _launch_cases("cuda"):
            want, got = torch.empty_like(x), torch.empty_like(x)
            grid = (triton.cdiv(n, 64),)
            _axpb_kernel[grid](x, want, n, 1.5, 2, BLOCK=64, SQUARE=square)
            key = (n, square)
            if key not in bound:
                extra = {"SQUARE": True} if square else {}  # else the constexpr default fills the tail
                bound[key] = det_launch.BoundLaunch(_axpb_kernel, 2, (n, 1.5, 2), BLOCK=64, **extra)
            bound[key](grid, x, got)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (x.data_ptr() % 16, n, square)
    if det_launch._direct_launch_enabled():
        assert any(b._entries for b in bound.values())


def test_plan_cache_is_bounded_and_returns_what_it_stores():
    cache = det_launch.PlanCache(limit=2)
    assert cache.put("a", 1) == 1 and cache.put("b", 2) == 2 and dict(cache) == {"a": 1, "b": 2}
    assert cache.put("c", 3) == 3 and dict(cache) == {"c": 3}  # full: emptied before the new plan


def test_descriptor_template_copies_equal_the_constructed_descriptor():
    """A template's copy for a new base is TensorDescriptor(base, ...) field for field, also when the
    template was validated with an empty tensor of the dtype (det_attn builds it so)."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    from triton.tools.tensor_descriptor import TensorDescriptor

    second = torch.randn(64, 128).to(torch.bfloat16)
    for make_probe in (lambda: torch.randn(64, 128).to(torch.bfloat16), lambda: second.new_empty(0)):
        probe = make_probe()
        template = det_launch.DescriptorTemplate(TensorDescriptor(probe, [64, 128], [128, 1], [32, 64]))
        got = template(second)
        assert type(got) is TensorDescriptor and got.base is second
        assert got == TensorDescriptor(second, [64, 128], [128, 1], [32, 64])
        assert template.block_shape == [32, 64]
        # a cached template does not keep the tensor it was validated with alive
        alive = weakref.ref(probe)
        del probe
        gc.collect()
        assert alive() is None


class CudaLauncher:
    """Stands in for Triton 3.6's ``CudaLauncher`` (matched by class name): its ``launch`` is either
    the module's C launch or wrap_handle_tensordesc's ``inner`` closing over it."""

    launch_cooperative_grid, launch_pdl = False, True
    global_scratch_size = profile_scratch_size = 0

    def __init__(self, c_launch, indices=None, meta=None):
        if indices is None:
            self.launch = c_launch
        else:
            launcher, tensordesc_indices, tensordesc_meta = c_launch, indices, meta

            def inner(*args):  # never called on the direct path
                return launcher, tensordesc_indices, tensordesc_meta, args

            inner.__module__, inner.__qualname__ = det_launch._TENSORDESC_WRAPPER  # as Triton 3.6 names it
            self.launch = inner
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


class _Compiled:
    function, packed_metadata = 1234, (4, 1, 0)

    def __init__(self, run):
        self.run = run


def test_compiled_launch_calls_the_c_launch_with_what_cuda_launcher_passes(monkeypatch):
    """Without descriptors: (grid, stream, function, cooperative, pdl, no scratch, metadata, no
    hooks, args), as CudaLauncher.__call__ passes them; a launcher needing scratch keeps its run."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    c = _Recorder()
    compiled = _Compiled(CudaLauncher(c))
    det_launch._CompiledLaunch(compiled)((3, 2), 0, ("x", 5, None))
    assert c.calls == [(3, 2, 1, 7, 1234, False, True, None, None, (4, 1, 0), None, None, None, "x", 5, None)]
    scratch = CudaLauncher(c)
    scratch.global_scratch_size = 64
    det_launch._CompiledLaunch(_Compiled(scratch))((3,), 0, ("x",))
    assert scratch.calls == [(3, 1, 1, 7, 1234, (4, 1, 0), None, None, None, "x")] and len(c.calls) == 1


def test_compiled_launch_encodes_descriptors_as_make_tensordesc_arg(monkeypatch):
    """Each descriptor argument becomes (encoded map, *shape, *strides) in place, with the encoding
    wrap_handle_tensordesc would pass (base address, swizzle, element size and host dtype, block,
    shape, strides, padding); host-decomposed descriptors (no metadata) keep Triton's wrapper."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    from triton.tools.tensor_descriptor import TensorDescriptor

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(det_launch, "_fill_tma_descriptor", lambda *a: ("map", a))
    a, b = torch.zeros(64, 32), torch.zeros(16, 8)
    da = TensorDescriptor(a, [64, 32], [32, 1], [16, 32])
    db = TensorDescriptor(b, [16, 8], [8, 1], [8, 8], padding="nan")
    meta = [dict(swizzle=128, elem_size=4, elem_type=7, block_size=[16, 32], fp4_padded=False),
            dict(swizzle=32, elem_size=4, elem_type=7, block_size=[8, 8], fp4_padded=False)]  # fmt: skip
    c = _Recorder()
    launch = det_launch._CompiledLaunch(_Compiled(CudaLauncher(c, {1, 3}, meta)))
    launch((2,), 0, ("p", da, 9, db, 1.5))
    host = __import__("triton.backends.nvidia.driver", fromlist=["x"]).TMA_DTYPE_DEVICE_TO_HOST[7]
    assert c.calls[0][13:] == (
        "p", ("map", (a.data_ptr(), 128, 4, host, [16, 32], [64, 32], [32, 1], 0)), 64, 32, 32, 1,
        9, ("map", (b.data_ptr(), 32, 4, host, [8, 8], [16, 8], [8, 1], 1)), 16, 8, 8, 1, 1.5,
    )  # fmt: skip
    for odd in ([None], [dict(meta[0], is_im2col=True)]):  # host-decomposed; a field it does not know
        wrapped = CudaLauncher(c, {1}, odd)
        det_launch._CompiledLaunch(_Compiled(wrapped))((2,), 0, ("p", da))
        assert len(wrapped.calls) == 1 and len(c.calls) == 1
    other = CudaLauncher(c, {1}, meta[:1])
    other.launch.__qualname__ = "another_wrapper.<locals>.inner"
    det_launch._CompiledLaunch(_Compiled(other))((2,), 0, ("p", da))
    assert len(other.calls) == 1 and len(c.calls) == 1


def test_bound_launch_keys_template_copies_by_layout(direct_launch):
    """Copies of one DescriptorTemplate share a launch key (their layout is computed once); another
    layout or a misaligned base is another key."""
    pytest.importorskip("triton.tools.tensor_descriptor")
    from triton.tools.tensor_descriptor import TensorDescriptor

    k = _FakeKernel()
    bound = det_launch.BoundLaunch(k, 1, (32, 5, 1.5), FLAG=True)
    x, y = torch.zeros(64, 32), torch.zeros(64, 32)
    template = det_launch.DescriptorTemplate(TensorDescriptor(x, [64, 32], [32, 1], [16, 32]))
    bound((1,), template(x))
    bound((1,), template(y))
    assert len(k.slow) == 1 and len(k.direct) == 1
    other = det_launch.DescriptorTemplate(TensorDescriptor(x, [64, 32], [32, 1], [32, 32]))
    bound((1,), other(y))
    bound((1,), template(torch.zeros(64 * 32 + 1)[1:].view(64, 32)))
    assert len(k.slow) == 3


@triton.jit
def _tma_scale_kernel(
    scale_ptr, in_desc, BM: tl.constexpr, out_desc, flag_ptr, scale2, BN: tl.constexpr, FLAG: tl.constexpr
):
    # a pointer, descriptors with a constexpr between them, a trailing scalar: positions to get right
    m, n = tl.program_id(0) * BM, tl.program_id(1) * BN
    tile = in_desc.load([m, n]).to(tl.float32) * tl.load(scale_ptr) * scale2
    out_desc.store([m, n], tile.to(out_desc.dtype))
    if FLAG and tl.program_id(0) == 0 and tl.program_id(1) == 0:
        tl.store(flag_ptr, 1.0)


@pytest.mark.gpu
def test_gpu_bound_launch_of_descriptors_equals_the_jit_path():
    """A kernel with a pointer, two tensor-descriptor parameters (a constexpr between them, the input
    NaN-padded) and a scalar through BoundLaunch (DescriptorTemplate copies, encoded by
    _CompiledLaunch from the second round on) gives kernel[grid]'s outputs, also at a shape whose
    edge tiles are partial."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    scale = torch.tensor([1.5], device="cuda")
    bound = det_launch.BoundLaunch(_tma_scale_kernel, 5, (0.5,), BN=64, FLAG=True)
    for _ in range(2):
        for rows, cols in ((128, 128), (100, 72)):
            x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
            want, got = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
            flag_want, flag_got = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
            grid = (triton.cdiv(rows, 32), triton.cdiv(cols, 64))

            def desc(t, padding="zero", rows=rows, cols=cols):
                return TensorDescriptor(t, [rows, cols], [cols, 1], [32, 64], padding=padding)

            _tma_scale_kernel[grid](scale, desc(x, "nan"), 32, desc(want), flag_want, 0.5, BN=64, FLAG=True)
            src, dst = det_launch.DescriptorTemplate(desc(x, "nan")), det_launch.DescriptorTemplate(desc(x))
            bound(grid, scale, src(x), 32, dst(got), flag_got)
            torch.cuda.synchronize()
            assert torch.equal(got, want) and torch.equal(want, (x.float() * 0.75).to(torch.bfloat16))
            assert flag_want.item() == flag_got.item() == 1.0
    if det_launch._direct_launch_enabled():  # one entry per layout, each launched by its C launcher
        entries = list(bound._entries.values())
        assert len(entries) == 2 and all(e.c_launch is not None and len(e.descs) == 2 for e in entries)
