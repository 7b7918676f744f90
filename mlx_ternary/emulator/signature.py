"""The Metal source MLX builds around a custom kernel body.

Mirrors mlx/backend/common/metal_kernel.cpp: the kernel name encodes the
template arguments and how each input is passed, inputs with fewer than 8
elements go to the constant address space, 0-d inputs are passed by
reference, and `<input>_shape/_strides/_ndim` and the thread attributes are
added when the body mentions them. test_emulator checks the result against
what MLX prints with verbose=True.
"""

import mlx.core as mx

MAX_CONSTANT_ARRAY_SIZE = 8

TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
}

# Attributes MLX declares when their name appears in the body, in its order.
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]


def type_string(dtype) -> str:
    try:
        return TYPE_STRINGS[dtype]
    except KeyError:
        raise ValueError(f"[metal_kernel] Unsupported dtype {dtype}.") from None


def write_template(template) -> str:
    """`<float, 3, 1>`: C++ prints bools as 1 and 0."""
    parts = []
    for _, arg in template:
        if isinstance(arg, bool):
            parts.append("1" if arg else "0")
        elif isinstance(arg, int):
            parts.append(str(arg))
        else:
            parts.append(type_string(arg))
    return "<" + ", ".join(parts) + ">"


def kernel_name(name: str, inputs, output_dtypes, template) -> str:
    """custom_kernel_<name>[_<template>]_<input types>_<output types>; an
    input type gets "s" when 0-d and "c" when in the constant space."""
    result = "custom_kernel_" + name
    if template:
        result += (
            "_"
            + write_template(template).replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
        )
    for arr in inputs:
        result += "_" + type_string(arr.dtype)
        if arr.ndim == 0:
            result += "s"
        elif arr.size < MAX_CONSTANT_ARRAY_SIZE:
            result += "c"
    for dtype in output_dtypes:
        result += "_" + type_string(dtype)
    return result


def attributes_used(source: str) -> list[tuple[str, str]]:
    return [(a, t) for a, t in ATTRIBUTES if a in source]


def shape_infos(input_names, source: str) -> list[tuple[bool, bool, bool]]:
    """Per input: does the body use <name>_shape, _strides, _ndim."""
    return [
        (n + "_shape" in source, n + "_strides" in source, n + "_ndim" in source)
        for n in input_names
    ]


def write_signature(
    name: str,
    header: str,
    source: str,
    input_names,
    inputs,
    output_names,
    output_dtypes,
    template,
    atomic_outputs: bool,
) -> str:
    """Header, template line, `[[kernel]] void name(...) {`, body, `}`."""
    attributes = attributes_used(source)
    src = header
    if template:
        params = []
        for pname, arg in template:
            kind = (
                "bool" if isinstance(arg, bool) else "int" if isinstance(arg, int) else "typename"
            )
            params.append(f"{kind} {pname}")
        src += "template <" + ", ".join(params) + ">\n"
    src += f"[[kernel]] void {name}(\n"
    index = 0
    for iname, arr, (has_shape, has_strides, has_ndim) in zip(
        input_names, inputs, shape_infos(input_names, source)
    ):
        location = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        src += f"  const {location} {type_string(arr.dtype)}{ref} {iname} [[buffer({index})]],\n"
        index += 1
        if arr.ndim > 0:
            if has_shape:
                src += f"  const constant int* {iname}_shape [[buffer({index})]],\n"
                index += 1
            if has_strides:
                src += f"  const constant int64_t* {iname}_strides [[buffer({index})]],\n"
                index += 1
            if has_ndim:
                src += f"  const constant int& {iname}_ndim [[buffer({index})]],\n"
                index += 1
    for oname, dtype in zip(output_names, output_dtypes):
        t = type_string(dtype)
        if atomic_outputs:
            t = f"atomic<{t}>"
        src += f"  device {t}* {oname} [[buffer({index})]]"
        # As MLX: the buffer index (which counts shape buffers too) against
        # the argument count.
        if index < len(inputs) + len(output_names) - 1 or attributes:
            src += ",\n"
        else:
            src += ") {\n"
        index += 1
    for i, (attr, t) in enumerate(attributes):
        src += f"  {t} {attr} [[{attr}]]"
        src += ",\n" if i < len(attributes) - 1 else ") {\n"
    return src + source + "\n}\n"


def instantiation(name: str, template) -> str:
    """The explicit instantiation MLX appends for a templated kernel."""
    inst = name + write_template(template)
    return f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
