"""CPU twin of the cached direct Triton launch (megatron/core/fp8/cuda/launch.py): a fake kernel
stands in for a Triton JITFunction, so the cache key, the argument order of the direct call and
the fallbacks run without a GPU. The real launcher is checked against Triton's own path on the
H200 by test_cuda_linear.py::test_cached_direct_launch_equals_triton_launch."""

import pytest
import torch

from megatron.core.fp8.cuda import launch


class FakeCompiled:
    def __init__(self, log, *, fail=False):
        self.log, self.fail = log, fail
        self.function, self.packed_metadata = "function", "metadata"
        self.initialised = False

    def _init_handles(self):
        self.initialised = True

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid)

    def run(self, *call):
        if self.fail:
            raise TypeError("function takes exactly 17 arguments (16 given)")
        self.log.append(("direct", call))


class FakeKernel:
    """kernel[grid](*args, **constexprs) as Triton's JITFunction: logs the call, compiles (a
    new FakeCompiled) once per specialization it is asked for, returns it."""

    arg_names = ["x_ptr", "n", "BLOCK", "FLAG"]

    def __init__(self, *, fail_direct=False):
        self.log, self.compiles, self.fail_direct = [], 0, fail_direct

    def __getitem__(self, grid):
        def call(*args, **constexprs):
            self.log.append(("jit", grid, args, constexprs))
            self.compiles += 1
            return FakeCompiled(self.log, fail=self.fail_direct)

        return call


class FakeRuntime:
    launch_enter_hook = None
    launch_exit_hook = None


@pytest.fixture
def fresh(monkeypatch):
    launch.reset_launch_cache()
    monkeypatch.setattr(launch, "_knobs", lambda: FakeRuntime)
    monkeypatch.setattr(launch, "_raw_stream", lambda device: 1234)
    yield
    launch.reset_launch_cache()  # no fake kernel stays cached


def test_second_launch_calls_the_compiled_kernel_with_constexprs_in_signature_order(fresh):
    kernel = FakeKernel()
    x = torch.zeros(64)
    constexprs = dict(FLAG=True, BLOCK=128, num_warps=4)  # not in signature order
    launch.launch(kernel, (8,), (x, 64), constexprs)
    launch.launch(kernel, (8,), (x, 64), constexprs)
    assert [entry[0] for entry in kernel.log] == ["jit", "direct"]
    grid_and_stream, rest = kernel.log[1][1][:4], kernel.log[1][1][4:]
    assert grid_and_stream == (8, 1, 1, 1234)
    assert rest[:3] == ("function", "metadata", ("meta", (8, 1, 1)))
    assert rest[3:5] == (None, None)  # the runtime's enter/exit hooks, passed through
    assert rest[5:] == (x, 64, 128, True)  # runtime args, then BLOCK and FLAG by name
    assert launch._direct["launches"] == 1
    assert launch.direct_launch_status() == "direct (1 launches)"


@pytest.mark.parametrize(
    "change",
    [
        "misaligned tensor",
        "int not divisible by 16",
        "int equal to 1",
        "int64 int",
        "other dtype",
        "other constexpr",
    ],
)
def test_anything_triton_specializes_on_compiles_anew(fresh, change):
    kernel = FakeKernel()
    base = torch.zeros(64, dtype=torch.float32)
    launch.launch(kernel, (1,), (base, 64), dict(BLOCK=128, FLAG=True))
    args, constexprs = (base, 64), dict(BLOCK=128, FLAG=True)
    if change == "misaligned tensor":
        args = (torch.zeros(65)[1:], 64)
        assert args[0].data_ptr() % 16 != 0
    elif change == "int not divisible by 16":
        args = (base, 65)
    elif change == "int equal to 1":
        args = (base, 1)
    elif change == "int64 int":
        args = (base, 2**31 + 16)
    elif change == "other dtype":
        args = (torch.zeros(64, dtype=torch.bfloat16), 64)
    else:
        constexprs = dict(BLOCK=256, FLAG=True)
    launch.launch(kernel, (1,), args, constexprs)
    assert kernel.compiles == 2 and [entry[0] for entry in kernel.log] == ["jit", "jit"]
    launch.launch(kernel, (1,), args, constexprs)
    assert kernel.log[-1][0] == "direct"


def test_same_specialization_with_other_values_is_a_cache_hit(fresh):
    kernel = FakeKernel()
    launch.launch(kernel, (1,), (torch.zeros(64), 64), dict(BLOCK=128, FLAG=False))
    launch.launch(kernel, (4,), (torch.ones(128), 32), dict(BLOCK=128, FLAG=False))
    assert kernel.compiles == 1 and kernel.log[-1][0] == "direct"
    assert kernel.log[-1][1][:3] == (4, 1, 1)


def test_a_failing_direct_call_relaunches_through_triton_and_turns_the_path_off(fresh):
    kernel = FakeKernel(fail_direct=True)
    x = torch.zeros(64)
    for _ in range(3):
        launch.launch(kernel, (1,), (x, 64), dict(BLOCK=128, FLAG=True))
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit"]
    assert not launch._direct["enabled"]
    assert "17 arguments" in launch.direct_launch_status()


def test_a_parameter_left_at_its_default_is_never_cached(fresh):
    kernel = FakeKernel()
    for _ in range(2):
        launch.launch(kernel, (1,), (torch.zeros(64), 64), dict(BLOCK=128))  # FLAG defaulted
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]


def test_without_triton_knobs_every_launch_goes_through_triton(fresh, monkeypatch):
    monkeypatch.setattr(launch, "_knobs", lambda: None)
    kernel = FakeKernel()
    for _ in range(2):
        launch.launch(kernel, (1,), (torch.zeros(64), 64), dict(BLOCK=128, FLAG=True))
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]


def test_under_torch_compile_tracing_the_plain_triton_call_is_kept(fresh, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    kernel = FakeKernel()
    for _ in range(2):
        launch.launch(kernel, (1,), (torch.zeros(64), 64), dict(BLOCK=128, FLAG=True))
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"] and not launch._compiled


# launch.LaunchSite: one call site whose compiled kernel is held per alignment key.

SITE_CONSTEXPRS = dict(FLAG=True, BLOCK=128, num_warps=4)  # not in signature order


def test_site_first_call_goes_through_triton_then_calls_the_held_kernel(fresh):
    kernel = FakeKernel()
    site = launch.LaunchSite(kernel, (8,), SITE_CONSTEXPRS)
    assert site.grid == (8, 1, 1)
    first, second = torch.zeros(64), torch.ones(64)
    site((first, 64), True)
    assert kernel.log == [("jit", (8, 1, 1), (first, 64), SITE_CONSTEXPRS)]
    assert list(site._held) == [True]
    compiled, tail, device, runtime = site._held[True]
    assert tail == (128, True) and device == -1 and runtime is FakeRuntime
    # The held kernel is used without the process-wide cache: emptying it changes nothing.
    launch.reset_launch_cache()
    site((second, 64), True)
    assert kernel.compiles == 1 and len(kernel.log) == 2
    kind, call = kernel.log[1]
    assert kind == "direct"
    assert call[:4] == (8, 1, 1, 1234)
    assert call[4:7] == ("function", "metadata", ("meta", (8, 1, 1)))
    assert call[7:9] == (None, None)
    assert call[9:] == (second, 64, 128, True)  # runtime args, then BLOCK and FLAG by name
    assert launch._direct["launches"] == 1


def test_site_grid_is_padded_to_three_dims():
    assert launch.LaunchSite(FakeKernel(), (5, 6), {}).grid == (5, 6, 1)
    assert launch.LaunchSite(FakeKernel(), (5, 6, 7), {}).grid == (5, 6, 7)


def test_site_holds_one_compiled_kernel_per_alignment_key(fresh):
    kernel = FakeKernel()
    site = launch.LaunchSite(kernel, (2,), dict(BLOCK=128, FLAG=False))
    aligned, misaligned = torch.zeros(64), torch.zeros(65)[1:]
    assert misaligned.data_ptr() % 16 != 0
    site((aligned, 64), True)
    site((misaligned, 64), False)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"] and kernel.compiles == 2
    assert kernel.log[1][2] == (misaligned, 64)
    site((misaligned, 64), False)
    site((aligned, 64), True)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "direct", "direct"]
    assert kernel.log[2][1][9:] == (misaligned, 64, 128, False)
    assert kernel.log[3][1][9:] == (aligned, 64, 128, False)
    assert sorted(site._held) == [False, True]
    held = {id(entry[0]) for entry in site._held.values()}
    assert len(held) == 2 and held == {id(entry[0]) for entry in launch._compiled.values()}
    assert launch._direct["launches"] == 2


def test_a_new_site_of_a_compiled_specialization_holds_it_without_compiling(fresh):
    kernel = FakeKernel()
    x = torch.zeros(64)
    launch.launch(kernel, (2, 1, 1), (x, 64), dict(BLOCK=128, FLAG=True))
    site = launch.LaunchSite(kernel, (2,), dict(BLOCK=128, FLAG=True))
    site((x, 64), "any key")
    site((x, 64), "any key")
    assert kernel.compiles == 1 and [entry[0] for entry in kernel.log] == [
        "jit",
        "direct",
        "direct",
    ]
    assert site._held["any key"][0] is next(iter(launch._compiled.values()))[0]


def test_site_goes_through_triton_every_time_while_the_direct_path_is_off(fresh):
    kernel = FakeKernel()
    site = launch.LaunchSite(kernel, (1,), dict(BLOCK=128, FLAG=True))
    launch.set_direct_launch(False)
    for _ in range(3):
        site((torch.zeros(64), 64), True)
    assert [entry[0] for entry in kernel.log] == ["jit"] * 3 and kernel.compiles == 3
    assert site._held == {} and launch._compiled == {}
    # Turned off after the site has held its kernel: the held kernel is no longer called.
    launch.set_direct_launch(True)
    site((torch.zeros(64), 64), True)
    assert list(site._held) == [True]
    launch.set_direct_launch(False)
    site((torch.zeros(64), 64), True)
    assert [entry[0] for entry in kernel.log] == ["jit"] * 5 and launch._direct["launches"] == 0


def test_a_failing_direct_site_call_relaunches_through_triton_and_turns_the_path_off(fresh):
    kernel = FakeKernel(fail_direct=True)
    constexprs = dict(BLOCK=128, FLAG=True)
    site = launch.LaunchSite(kernel, (3,), constexprs)
    x = torch.zeros(64)
    site((x, 64), True)
    site((x, 64), True)  # the held kernel raises: relaunched as kernel[grid](...)
    assert kernel.log[1] == ("jit", (3, 1, 1), (x, 64), constexprs)
    assert not launch._direct["enabled"] and launch._direct["launches"] == 0
    assert launch._direct["why_not"] == "TypeError: function takes exactly 17 arguments (16 given)"
    site((x, 64), True)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit"] and kernel.compiles == 3


def test_under_torch_compile_tracing_a_site_holds_nothing(fresh, monkeypatch):
    kernel = FakeKernel()
    x = torch.zeros(64)
    # Compiled and remembered by an eager launch first: a site could find it in the cache.
    launch.launch(kernel, (1,), (x, 64), dict(BLOCK=128, FLAG=True))
    assert len(launch._compiled) == 1
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    site = launch.LaunchSite(kernel, (1,), dict(BLOCK=128, FLAG=True))
    for _ in range(2):
        site((x, 64), True)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit"]
    assert kernel.log[1] == kernel.log[2] == ("jit", (1, 1, 1), (x, 64), dict(BLOCK=128, FLAG=True))
    assert site._held == {} and launch._direct["launches"] == 0


def test_a_site_holding_a_kernel_keeps_tritons_call_under_torch_compile_tracing(fresh, monkeypatch):
    """A site that holds a kernel from eager steps must not call it directly while
    torch.compile traces (the arguments are then fake tensors): launch() keeps kernel[grid]."""
    kernel = FakeKernel()
    x = torch.zeros(64)
    site = launch.LaunchSite(kernel, (2,), dict(BLOCK=128, FLAG=True))
    site((x, 64), True)
    site((x, 64), True)
    assert [entry[0] for entry in kernel.log] == ["jit", "direct"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    site((x, 64), True)
    assert [entry[0] for entry in kernel.log] == ["jit", "direct", "jit"]
    assert kernel.log[2] == ("jit", (2, 1, 1), (x, 64), dict(BLOCK=128, FLAG=True))
    assert launch._direct["launches"] == 1
