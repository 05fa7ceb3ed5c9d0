"""Streaming DiLoCo's fragments: which parameters are exchanged together.

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512, §2.2) splits the model into F
fragments of whole layers and exchanges each at its own step of the period, so that the largest
exchange is about 1/F of the model (the peak bandwidth). It found a *strided* pattern (layer i in
fragment i mod F) slightly better than contiguous blocks of layers; that is what
:func:`split_fragments` deals.

"Layers" are the children of the model's largest ``nn.ModuleList`` / ``nn.Sequential`` (the one
holding the most parameters; a GPT's ``blocks``, an MLP's ``Sequential`` itself) that hold
parameters. The parameters outside it (embeddings, a final norm, a head) are each given to the
fragment with the fewest elements so far, in registration order, so the fragments stay close to
equal. A fragment is a list of indices into the model's parameters in ``named_parameters()`` order
(shared parameters once).
"""

from __future__ import annotations

from torch import nn

FIELD = "DiLoCoConfig.fragments"


def model_layers(model: nn.Module) -> tuple[str, list[str]]:
    """The model's layers: ``(container name, [qualified names of its children that hold
    parameters])`` for its largest ``ModuleList``/``Sequential`` (most parameters; the first
    found on a tie); ``("", [])`` when it has none."""
    best: tuple[int, str, list[str]] = (0, "", [])
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [
            (f"{name}.{child}" if name else child, sub)
            for child, sub in module.named_children()
            if any(True for _ in sub.parameters())
        ]
        total = sum(p.numel() for _, sub in children for p in sub.parameters())
        if total > best[0]:
            best = (total, name, [qualified for qualified, _ in children])
    return best[1], best[2]


def split_fragments(model: nn.Module, fragments: int) -> list[list[int]]:
    """Deal ``model``'s parameters into ``fragments`` fragments (see the module docs).

    Args:
        model: the unwrapped module.
        fragments: F >= 1; 1 gives one fragment holding every parameter.

    Returns:
        F lists of parameter indices (``named_parameters()`` order), each sorted, together
        covering every parameter exactly once.

    Raises:
        ValueError: naming ``DiLoCoConfig.fragments``: the model has fewer than F layers, or its
            number of layers is not a multiple of F (the fragments would be unequal: the
            message lists the values that divide it).
    """
    named = list(model.named_parameters())
    if fragments == 1:
        return [list(range(len(named)))]
    container, layers = model_layers(model)
    where = f"'{container}'" if container else "the model itself"
    if len(layers) < fragments:
        raise ValueError(
            f"{FIELD}={fragments}: the model has {len(layers)} layers (children holding "
            f"parameters of its largest ModuleList/Sequential, {where}), fewer than the "
            "fragments; use fragments=1 (plain DiLoCo) or at most "
            f"{max(1, len(layers))}"
        )
    if len(layers) % fragments:
        divisors = [d for d in range(1, len(layers) + 1) if len(layers) % d == 0]
        raise ValueError(
            f"{FIELD}={fragments} does not divide the model's {len(layers)} layers (in {where}) "
            f"into equal fragments; use one of {divisors}"
        )
    out: list[list[int]] = [[] for _ in range(fragments)]
    sizes = [0] * fragments
    loose: list[int] = []
    for index, (name, param) in enumerate(named):
        layer = next((i for i, prefix in enumerate(layers) if name.startswith(prefix + ".")), None)
        if layer is None:
            loose.append(index)
            continue
        out[layer % fragments].append(index)
        sizes[layer % fragments] += param.numel()
    for index in loose:
        lightest = min(range(fragments), key=lambda f: (sizes[f], f))
        out[lightest].append(index)
        sizes[lightest] += named[index][1].numel()
    return [sorted(fragment) for fragment in out]
