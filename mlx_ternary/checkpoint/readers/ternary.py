"""Reader for the ternary format (mlx-ternary's own) (docs/FORMAT.md).

Tensors are named as the model's parameters already. `P.packed` + `P.scales` is a
ternary layer; `P.weight` + `P.scales` + `P.biases` of a layer the quantization section
lists is an MLX affine layer (format_version 2, or a v1 model that mlx-lm's
quantize_model added such layers to); `P.weight` of a layer listed with mode "ggml" holds
llama.cpp's blocks as stored (format_version 3). Arrays stay lazy: nothing is read until used.
"""

from pathlib import Path

from ...errors import FormatError
from ...format import (
    GGML_MODE,
    GGMLTensor,
    PackedTernary,
    QuantizationConfig,
    is_ternary_config,
    packed_shape,
    scale_kind,
    scales_shape,
)
from . import arch
from .common import Source, read_tensor, shard_files, tensor_index


def detect(path: Path) -> bool:
    return path.is_dir() and is_ternary_config(arch.read_config(path))


def source(path: Path, packing: str = "compact") -> Source:
    """A Source for a ternary checkpoint; `packing` is ignored (the stored one is kept)."""
    config = arch.read_config(path)
    quant = QuantizationConfig.from_dict(config["quantization"], path / "config.json")
    model = arch.skeleton(config, path)
    targets = arch.ternary_targets(model, config)
    index = tensor_index(shard_files(path))
    triples, companions = arch.affine_triples(set(index))
    ggml = {p: e["type"] for p, e in quant.layers.items() if e["mode"] == GGML_MODE}
    affine = {n: p for n, p in triples.items() if p in quant.layers and p not in ggml}
    dims = {p: m.weight.shape[-1] for p, m in model.named_modules() if p in quant.layers}
    skip = {n for n in index if n.endswith(".scales") and n[:-7] + ".packed" in index}
    skip |= {n for n in companions if n.rpartition(".")[0] in quant.layers}
    order = [n for n in index if n not in skip]

    def read(name):
        if name not in index:
            raise FormatError(
                f"{path}: tensor {name} is missing (its layer's other tensors are there); "
                "re-download or re-convert the model"
            )
        return read_tensor(name, index[name])

    def items():
        for name in order:
            p, _, leaf = name.rpartition(".")
            if name in affine:
                yield (
                    p,
                    arch.affine_tensor(
                        p,
                        read(name),
                        read(f"{p}.scales"),
                        read(f"{p}.biases") if f"{p}.biases" in index else None,
                        dims[p],
                        quant.layers,
                        path.name,
                    ),
                )
            elif leaf == "weight" and p in ggml:
                yield p, _blocks(p, read(name), ggml[p], dims[p], path)
            elif leaf == "packed" and p in targets:
                yield p, _packed(p, read(name), read(f"{p}.scales"), targets[p], quant, path)
            else:
                yield name, read(name)

    return Source(
        path=path,
        kind=f"mlx-ternary ({quant.packing})",
        config=arch.architecture(config),
        count=len(order),
        items=items,
        activation_bits=quant.activation_bits,
        activations=quant.activations,
        group_size=quant.group_size,
        tokenizer_dir=path,
        model=model,
        targets=targets,
    )


def _packed(
    path: str, packed, scales, dims: tuple, quant: QuantizationConfig, where: Path
) -> PackedTernary:
    k, n, _ = dims
    if scales.ndim != 2:
        raise FormatError(
            f"{where}: tensor {path}.scales has shape {tuple(scales.shape)}; ternary "
            "scales are 2-D (rows, groups)"
        )
    kind = scale_kind(tuple(scales.shape), n)
    gs = quant.group_size if kind == "group" else None
    for leaf, arr, want in (
        ("packed", packed, packed_shape(quant.packing, n, k, gs)),
        ("scales", scales, scales_shape(kind, n, k, gs)),
    ):
        if tuple(arr.shape) != want:
            raise FormatError(
                f"{where}: tensor {path}.{leaf} has shape {tuple(arr.shape)}, "
                f"the config implies {want}; the config and the weights do not "
                "belong together"
            )
    return PackedTernary(quant.packing, packed, scales, n, k, gs)


def _blocks(path: str, blocks, type_name: str, in_features: int, where: Path) -> GGMLTensor:
    try:
        return GGMLTensor(blocks, type_name, in_features)
    except FormatError as e:
        raise FormatError(
            f"{where}: tensor {path}.weight: {e}; the config and the weights do not belong together"
        ) from None
