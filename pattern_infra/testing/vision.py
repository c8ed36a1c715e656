"""The vision zoo: torchvision and timm image models as people deploy them, with random weights.

Each builder returns ``(module, (image,))`` like :mod:`pattern_infra.testing.models`: an ``eval()``-mode
model built from its library's own constructor (``weights=None`` / ``pretrained=False``: nothing is
downloaded) and one seeded image batch. Inputs are smaller than the models' 224 x 224 where the model
allows it (64 x 64 for most: convolutions, pooling and windowed or patch attention handle any multiple
of the total stride), so one conversion takes seconds.

**Importing torchvision beside the CPU torch.** The project pins the CPU build of ``torch==2.13.0``;
``torchvision==0.28.0`` matches it, but its PyPI wheel is a CUDA build whose compiled ops (``_C.so``:
``nms``, ``roi_align``, ...) do not load beside a CPU torch. torchvision's ``extension`` module notices
that and carries on; its ``_meta_registrations`` module does not: it registers fake kernels with
``torch.library.register_fake("torchvision::nms")``, which raises ``RuntimeError: operator
torchvision::nms does not exist``, so ``import torchvision`` fails, and with it ``transformers``, which
imports torchvision whenever it is installed (``from transformers import LlamaForCausalLM`` fails).
:func:`install_torchvision_shim` puts an empty module in ``sys.modules["torchvision._meta_registrations"]``
before torchvision is imported: fake kernels for ops that do not exist are not needed, and every model
of ``torchvision.models`` is plain PyTorch. If the compiled ops do load (a matching CPU wheel), the real
module is imported after all. :mod:`pattern_infra.testing.hf_models` and the test suite's ``conftest``
call the shim before ``transformers`` is imported. ``import coremltools`` tries torchvision before any
of them, inside a ``try`` (its ``_HAS_TORCH_VISION``, read only by ``coremltools.optimize.torch``'s
graph utilities): that attempt fails quietly, and a later import with the shim succeeds.

**Weights.** Seeded random weights, and every parameter or buffer a fresh model holds constant
(batch-norm, group-norm and layer-norm weights and biases, running statistics, zero biases, layer scales
at ``1e-6``, class tokens) redrawn by :func:`randomize_constants`: a trained model never has those values,
and coremltools' passes would otherwise delete a ``mul`` by 1 or an ``add`` of 0 and hide the fold a pass
has to make. The batch norms' running statistics are then those of their inputs on random images
(:func:`calibrate_batch_norms`), as training leaves them. The re-parameterisable timm models (FastViT,
MobileOne, RepViT) are randomised and calibrated first, then re-parameterised with
``timm.utils.reparameterize_model``, as they are deployed.

This module imports :mod:`torch`, torchvision and timm on first use (the test suite's ``conftest`` imports
it for the shim alone); it is imported by tests and examples only.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from .models import ModelAndArgs

__all__ = [
    "FAST",
    "TIMM",
    "TORCHVISION",
    "VISION_ZOO",
    "import_timm",
    "import_torchvision",
    "install_torchvision_shim",
    "calibrate_batch_norms",
    "randomize_constants",
]

_META = "torchvision._meta_registrations"


def install_torchvision_shim() -> None:
    """Make ``import torchvision`` work where its compiled ops do not load (see the module docstring).

    Registers an empty module as ``torchvision._meta_registrations`` unless torchvision is already
    imported or not installed. Idempotent; :func:`import_torchvision` undoes it when the ops did load.
    """
    if "torchvision" in sys.modules or _META in sys.modules:
        return
    if importlib.util.find_spec("torchvision") is None:
        return
    shim = types.ModuleType(_META)
    shim.__doc__ = "Empty stand-in (pattern_infra.testing.vision): torchvision's C ops did not load."
    sys.modules[_META] = shim


def import_torchvision() -> Any:
    """``torchvision``, imported with :func:`install_torchvision_shim` first.

    Returns:
        The ``torchvision`` module.
    """
    install_torchvision_shim()
    import torchvision

    shim = sys.modules.get(_META)
    if torchvision.extension._has_ops() and shim is not None and not hasattr(shim, "get_meta_lib"):
        del sys.modules[_META]  # the compiled ops loaded: their fake kernels are wanted after all
        torchvision._meta_registrations = importlib.import_module(_META)
    return torchvision


def import_timm() -> Any:
    """``timm``, with torchvision importable first (timm imports it when it is installed).

    Returns:
        The ``timm`` module.
    """
    import_torchvision()
    import timm

    return timm


def randomize_constants(module: nn.Module, seed: int = 0) -> None:
    """Redraw every floating parameter and buffer whose elements are all equal.

    A zero becomes ``0.1 * N(0, 1)``; a tiny value (a layer scale's ``1e-5``, ``|c| < 0.01``) becomes
    ``0.5 + 0.1 * N(0, 1)``; any other ``c`` becomes ``c * (1 + 0.1 * N(0, 1))``, which keeps running
    variances (1) positive. Tensors drawn at random already are left as they are.

    Args:
        module: The model, changed in place.
        seed: Seed of the draws.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors = [t for _, t in module.named_parameters()] + [t for _, t in module.named_buffers()]
    with torch.no_grad():
        for tensor in tensors:
            if not tensor.is_floating_point() or tensor.numel() == 0:
                continue
            first = tensor.flatten()[0]
            if not bool((tensor == first).all()):
                continue
            noise = torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            c = float(first)
            if c == 0.0:
                tensor.copy_(0.1 * noise)
            elif abs(c) < 0.01:
                tensor.copy_(0.5 + 0.1 * noise)
            else:
                tensor.copy_(c * (1.0 + 0.1 * noise.clamp(-3.0, 3.0)))


def calibrate_batch_norms(model: nn.Module, size: int, seed: int = 0) -> None:
    """Set every batch norm's running statistics to those of its inputs on 4 random images.

    A trained model's statistics match the activations its batch norms see; random ones do not, and a
    network of many parallel branches (MobileOne sums six per block) then grows its activations by a
    factor per block, to 1e14 at the output. One forward pass in training mode with a cumulative average
    (``momentum=None``) sets them as training would; no weight changes.

    Args:
        model: The model, changed in place and left in ``eval()`` mode.
        size: Height and width of the images.
        seed: Seed of the images.
    """
    import torch

    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    images = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(seed + 1))
    model.train()
    with torch.no_grad():
        model(images)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
    model.eval()


def _finish(model: nn.Module, size: int, seed: int, reparameterize: bool = False) -> ModelAndArgs:
    import torch

    randomize_constants(model, seed)
    calibrate_batch_norms(model, size, seed)
    model.eval()  # the libraries build in training mode: dropout and stochastic depth would be exported
    if reparameterize:
        model = import_timm().utils.reparameterize_model(model)
        model.eval()
    image = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(seed))
    return model, (image,)


def _torchvision(name: str, size: int = 64, **kwargs: Any) -> Callable[[], ModelAndArgs]:
    def build() -> ModelAndArgs:
        import torch

        torch.manual_seed(0)
        model = getattr(import_torchvision().models, name)(weights=None, **kwargs)
        return _finish(model, size, 0)

    build.__name__ = f"torchvision_{name}"
    build.__doc__ = f"``torchvision.models.{name}(weights=None)`` on a {size} x {size} image."
    return build


def _vit_small() -> ModelAndArgs:
    """torchvision's ``VisionTransformer`` (the class of ``vit_b_16``) at ViT-S/16's size, 64 x 64 image:
    6 layers of width 384 over 16 patches and the class token."""
    import torch

    torch.manual_seed(0)
    vit = import_torchvision().models.VisionTransformer
    model = vit(image_size=64, patch_size=16, num_layers=6, num_heads=6, hidden_dim=384, mlp_dim=1536)
    return _finish(model, 64, 0)


def _timm(
    name: str, size: int = 64, reparameterize: bool = False, **kwargs: Any
) -> Callable[[], ModelAndArgs]:
    def build() -> ModelAndArgs:
        import torch

        torch.manual_seed(0)
        model = import_timm().create_model(name, pretrained=False, **kwargs)
        return _finish(model, size, 0, reparameterize)

    build.__name__ = f"timm_{name}"
    how = ", re-parameterised" if reparameterize else ""
    build.__doc__ = f"``timm.create_model({name!r}, pretrained=False)``{how}, on a {size} x {size} image."
    return build


TORCHVISION: dict[str, Callable[[], ModelAndArgs]] = {
    "resnet18": _torchvision("resnet18"),
    "mobilenet_v2": _torchvision("mobilenet_v2"),
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small"),
    "efficientnet_b0": _torchvision("efficientnet_b0"),
    "regnet_y_400mf": _torchvision("regnet_y_400mf"),
    "shufflenet_v2_x0_5": _torchvision("shufflenet_v2_x0_5"),
    "squeezenet1_1": _torchvision("squeezenet1_1"),
    "convnext_tiny": _torchvision("convnext_tiny"),
    "vit_s_16": _vit_small,
    "swin_t": _torchvision("swin_t"),
}
"""torchvision's classification families. Swin-T at 64 x 64: the last stages' 2 x 2 and 4 x 4 maps are
padded to one 7 x 7 window, unshifted (torchvision's own rule for a window as large as the map)."""

TIMM: dict[str, Callable[[], ModelAndArgs]] = {
    "mobilevit_xxs": _timm("mobilevit_xxs"),
    "mobilevitv2_050": _timm("mobilevitv2_050"),
    "poolformerv2_s12": _timm("poolformerv2_s12"),
    "efficientformer_l1": _timm("efficientformer_l1", size=224),
    "fastvit_t8": _timm("fastvit_t8", reparameterize=True),
    "levit_128s": _timm("levit_128s", size=128, img_size=128),
    "repvit_m0_9": _timm("repvit_m0_9", reparameterize=True),
    "mobileone_s0": _timm("mobileone_s0", reparameterize=True),
    "efficientvit_b0": _timm("efficientvit_b0"),
    "convnext_atto": _timm("convnext_atto"),
}
"""timm families beyond torchvision's: mobile hybrids with attention (MobileViT, MobileViT v2 with its
GroupNorm1 and separable attention, EfficientViT-B's ReLU linear attention, LeViT), MetaFormers
(PoolFormer v2's GroupNorm1 and layer scales, EfficientFormer, at 224 x 224: its last stage's attention
biases are sized for a 7 x 7 map), re-parameterised mobile CNNs (FastViT, RepViT, MobileOne) and timm's
ConvNeXt (its blocks channels-last, ``conv_mlp=False``, like torchvision's)."""

VISION_ZOO: dict[str, Callable[[], ModelAndArgs]] = {**TORCHVISION, **TIMM}
"""Every vision model, torchvision's first."""

FAST: tuple[str, ...] = ("squeezenet1_1", "mobilenet_v3_small", "fastvit_t8")
"""The models ``make test`` converts; the others run under ``make models`` (``--run-slow``)."""
