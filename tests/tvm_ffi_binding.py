"""The checks TVM-FFI makes when a compiled kernel is called, in Python for CPU tests (the real
ones run on the GPU only: the device is checked first): each tensor against the fake tensor it
was compiled with. A size symbol shared by several tensors binds one size, fixed sizes and
strides must be equal, symbolic strides multiples of their declared divisibility, and None is
passed exactly where None was compiled."""


def assert_binds(compiled, args, what: str = "") -> None:
    """compiled: the fake arguments (less the stream), args: the launch's, in order."""
    assert len(args) == len(compiled), f"{what}: {len(args)} arguments, compiled with {len(compiled)}"
    bound: dict[int, int] = {}
    for i, (fake, arg) in enumerate(zip(compiled, args, strict=True)):
        if fake is None or arg is None:
            assert fake is None and arg is None, (
                f"{what} argument {i}: None where a tensor was compiled, or not"
            )
            continue
        if not hasattr(fake, "shape") or not hasattr(arg, "stride"):
            continue  # a scalar or a stream
        for dim, (size, n) in enumerate(zip(fake.shape, arg.shape, strict=True)):
            if isinstance(size, int):
                assert size == n, f"{what} argument {i} mode {dim}: {n}, compiled {size}"
            else:  # the same symbol object wherever the fake arguments share it
                assert bound.setdefault(id(size), n) == n, (
                    f"{what} argument {i} mode {dim}: {n} vs {bound[id(size)]}"
                )
        for dim, (stride, n) in enumerate(zip(fake.stride, arg.stride(), strict=True)):
            if isinstance(stride, int):
                assert stride == n, f"{what} argument {i} stride {dim}: {n}, compiled {stride}"
            else:
                assert n % stride.divisibility == 0, (
                    f"{what} argument {i} stride {dim}: {n} % {stride.divisibility}"
                )
