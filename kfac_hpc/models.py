"""Model zoo: the reference training driver and the scale planner build models by name.

Every model is built from ``nn.Linear``, ``nn.Conv2d`` (``groups=1``) and
``nn.BatchNorm2d`` only (plus parameter-free ReLU/pooling/flatten), so every weight
layer is one that K-FAC supports. Activations are never in-place: full backward
hooks on a layer's output forbid in-place changes of that output.

Initialisation draws only from torch's global RNG, so ``torch.manual_seed(s)``
followed by :func:`build_model` gives bit-identical parameters on every rank.

Names (see :func:`model_names`):

* ``mlp``: Linear-ReLU-...-Linear on flattened input (``hidden=(128, 64)``).
* ``resnet20`` / ``resnet32`` / ``resnet56``: CIFAR ResNets of He et al. (2016),
  3 stages of n basic blocks (n = 3, 5, 9) with 16/32/64 channels. Shortcuts that
  change shape are 1x1 conv + BN ("option B"), so K-FAC sees them as Conv2d layers;
  this adds 2,752 parameters to the paper's option-A count (0.27M for resnet20).
* ``resnet50``: ImageNet bottleneck ResNet-50 ([3, 4, 6, 3], stride in the 3x3
  conv as in torchvision, 25,557,032 parameters for 1000 classes). ``stem="auto"``
  uses the 7x7/2 conv + 3x3/2 max-pool stem, or a 3x3/1 conv without pooling (the
  usual CIFAR stem) when ``image_size < 64``.
* ``gpt``: a small decoder-only transformer language model (token and positional
  ``nn.Embedding``, pre-LayerNorm blocks with causal self-attention whose q/k/v/out
  projections are ``nn.Linear``, a GELU MLP, a Linear head); ``num_classes`` is the
  vocabulary (256 for ``stdlib-text`` bytes), ``input_dim`` the context length. Options
  ``dim=64, depth=2, heads=4, mlp_ratio=4, context``. Its LayerNorms are the exception to
  the first rule: K-FAC leaves them to the optimizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from kfac_hpc.factory_options import coerce_options

__all__ = ["GPT", "BasicBlock", "Bottleneck", "build_model", "model_names", "register_model"]

ModelBuilder = Callable[..., nn.Module]

#: name -> builder(num_classes=, in_channels=, image_size=, input_dim=, **options)
_REGISTRY: dict[str, ModelBuilder] = {}
_COMMON_ARGS = ("num_classes", "in_channels", "image_size", "input_dim")


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Make a decorator that adds a builder to the registry under ``name``.

    A builder takes the keyword arguments ``num_classes``, ``in_channels``,
    ``image_size``, ``input_dim`` plus its own keyword-only options.

    Args:
        name: The name :func:`build_model` accepts.

    Returns:
        The decorator; it returns the builder unchanged.
    """

    def wrap(fn: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return wrap


def model_names() -> list[str]:
    """List the names accepted by :func:`build_model`, sorted."""
    return sorted(_REGISTRY)


def build_model(
    name: str,
    *,
    num_classes: int,
    in_channels: int = 3,
    image_size: int | None = None,
    input_dim: int | None = None,
    **options: object,
) -> nn.Module:
    """Build the model registered as ``name``.

    Args:
        name: one of :func:`model_names`.
        num_classes: size of the output layer.
        in_channels: input channels of the conv nets (ignored by ``mlp``).
        image_size: input height/width; conv nets do not need it (global average
            pooling) except ``resnet50``'s automatic stem choice; ``mlp`` uses
            ``in_channels * image_size**2`` when ``input_dim`` is not given.
        input_dim: number of input features of ``mlp`` (ignored by conv nets).
        options: model-specific keyword options, e.g. ``hidden=(256, 128)`` for
            ``mlp``, ``stem="cifar"`` for ``resnet50``, ``zero_init_residual=True``.

    Raises:
        ValueError: unknown name or option, an option value that does not fit the
            builder's annotation (:func:`kfac_hpc.factory_options.coerce_options`), or
            inconsistent sizes.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(model_names())}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if in_channels < 1:
        raise ValueError(f"in_channels must be >= 1, got {in_channels}")
    builder = _REGISTRY[name]
    accepted = [p for p in inspect.signature(builder).parameters if p not in _COMMON_ARGS]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"model {name!r} does not take option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(accepted) or '(none)'}"
        )
    options = coerce_options(builder, options)
    return builder(
        num_classes=num_classes,
        in_channels=in_channels,
        image_size=image_size,
        input_dim=input_dim,
        **options,
    )


# ---------------------------------------------------------------------------- mlp


class MLP(nn.Sequential):
    """Flatten, then Linear-ReLU blocks of widths ``hidden``, then a Linear classifier."""

    def __init__(self, input_dim: int, hidden: Sequence[int], num_classes: int) -> None:
        """Build the layers.

        Args:
            input_dim: Input features (after flattening).
            hidden: Widths of the hidden layers, in order (may be empty).
            num_classes: Outputs of the classifier.
        """
        layers: list[nn.Module] = [nn.Flatten()]
        width = input_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)


@register_model("mlp")
def _mlp(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int | None,
    input_dim: int | None,
    hidden: Sequence[int] = (128, 64),
) -> nn.Module:
    if input_dim is None:
        if image_size is None:
            raise ValueError(
                "mlp needs input_dim (or image_size, giving in_channels*image_size**2)"
            )
        input_dim = in_channels * image_size * image_size
    if input_dim < 1:
        raise ValueError(f"input_dim must be >= 1, got {input_dim}")
    hidden = tuple(int(h) for h in hidden)
    if any(h < 1 for h in hidden):
        raise ValueError(f"hidden widths must be >= 1, got {hidden}")
    return MLP(input_dim, hidden, num_classes)


# ------------------------------------------------------------------------ resnets


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


def _projection(cin: int, cout: int, stride: int) -> nn.Module | None:
    """1x1 conv + BN shortcut when the shape changes, else ``None`` (identity)."""
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """Two 3x3 convs with BN; ReLU after the residual sum."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        """Build the block.

        Args:
            cin: Input channels.
            width: Output channels.
            stride: Stride of the first conv (2 halves the resolution); a 1x1 projection
                shortcut is added when the shape changes.
        """
        super().__init__()
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        self.shortcut = _projection(cin, width, stride)

    def last_bn(self) -> nn.BatchNorm2d:
        """Return the BatchNorm before the residual sum (zeroed by ``zero_init_residual``)."""
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(b, cin, h, w)`` to ``(b, width, h / stride, w / stride)``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.shortcut is None else self.shortcut(x)
        result: torch.Tensor = self.relu(out + identity)
        return result


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4; ReLU after the sum."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        """Build the block.

        Args:
            cin: Input channels.
            width: Channels of the inner 3x3 conv; the output has ``4 * width``.
            stride: Stride of the 3x3 conv (2 halves the resolution); a 1x1 projection
                shortcut is added when the shape changes.
        """
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut = _projection(cin, cout, stride)

    def last_bn(self) -> nn.BatchNorm2d:
        """Return the BatchNorm before the residual sum (zeroed by ``zero_init_residual``)."""
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(b, cin, h, w)`` to ``(b, 4 * width, h / stride, w / stride)``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.shortcut is None else self.shortcut(x)
        result: torch.Tensor = self.relu(out + identity)
        return result


class ResNet(nn.Module):
    """Stem, stages of residual blocks, global average pooling, Linear classifier."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        depths: Sequence[int],
        widths: Sequence[int],
        *,
        stem: nn.Module,
        stem_channels: int,
        num_classes: int,
        zero_init_residual: bool = False,
    ) -> None:
        """Build the network; convs get Kaiming-normal weights, BatchNorms ones and zeros.

        Args:
            block: The residual block class.
            depths: Blocks per stage.
            widths: Width per stage (the block's ``width``); every stage after the first
                halves the resolution.
            stem: The input layers.
            stem_channels: Channels the stem outputs.
            num_classes: Outputs of the classifier.
            zero_init_residual: Zero the last BatchNorm of every block, so each block starts
                as the identity.
        """
        super().__init__()
        self.stem = stem
        stages: list[nn.Module] = []
        cin = stem_channels
        for i, (depth, width) in enumerate(zip(depths, widths, strict=True)):
            blocks: list[nn.Module] = []
            for j in range(depth):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(cin, width, stride))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        self._init_weights(zero_init_residual)

    def _init_weights(self, zero_init_residual: bool) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # nn.Linear keeps PyTorch's default init (seeded by the global RNG).
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock | Bottleneck):
                    nn.init.zeros_(m.last_bn().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(b, c, h, w)`` to logits ``(b, num_classes)``."""
        x = self.stages(self.stem(x))
        result: torch.Tensor = self.fc(torch.flatten(self.pool(x), 1))
        return result


def _cifar_stem(in_channels: int, channels: int) -> nn.Module:
    return nn.Sequential(_conv3x3(in_channels, channels), nn.BatchNorm2d(channels), nn.ReLU())


def _imagenet_stem(in_channels: int, channels: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, kernel_size=7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
    )


def _cifar_resnet(n: int, num_classes: int, in_channels: int, zero_init_residual: bool) -> ResNet:
    return ResNet(
        BasicBlock,
        (n, n, n),
        (16, 32, 64),
        stem=_cifar_stem(in_channels, 16),
        stem_channels=16,
        num_classes=num_classes,
        zero_init_residual=zero_init_residual,
    )


def _register_cifar_resnet(depth: int) -> None:
    n = (depth - 2) // 6

    def builder(
        *,
        num_classes: int,
        in_channels: int,
        image_size: int | None,
        input_dim: int | None,
        zero_init_residual: bool = False,
    ) -> nn.Module:
        return _cifar_resnet(n, num_classes, in_channels, zero_init_residual)

    builder.__doc__ = f"CIFAR ResNet-{depth}: 3 stages of {n} basic blocks, 16/32/64 channels."
    register_model(f"resnet{depth}")(builder)


for _depth in (20, 32, 56):
    _register_cifar_resnet(_depth)


@register_model("resnet50")
def _resnet50(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int | None,
    input_dim: int | None,
    stem: str = "auto",
    zero_init_residual: bool = False,
) -> nn.Module:
    """ImageNet ResNet-50; ``stem`` is ``"imagenet"``, ``"cifar"`` or ``"auto"``."""
    if stem == "auto":
        stem = "cifar" if image_size is not None and image_size < 64 else "imagenet"
    if stem not in ("imagenet", "cifar"):
        raise ValueError(f"resnet50 stem must be 'auto', 'imagenet' or 'cifar', got {stem!r}")
    stem_module = (_imagenet_stem if stem == "imagenet" else _cifar_stem)(in_channels, 64)
    return ResNet(
        Bottleneck,
        (3, 4, 6, 3),
        (64, 128, 256, 512),
        stem=stem_module,
        stem_channels=64,
        num_classes=num_classes,
        zero_init_residual=zero_init_residual,
    )


# --------------------------------------------------------------------- transformer


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with ``nn.Linear`` q/k/v/out projections.

    The projections are separate ``nn.Linear`` modules whose forward is called (not
    ``nn.MultiheadAttention``, which uses ``out_proj.weight`` directly), so K-FAC
    preconditions all four, over the ``b·T`` positions (expand).
    """

    def __init__(self, dim: int, heads: int) -> None:
        """Build the four projections.

        Args:
            dim: Model width; a multiple of ``heads``.
            heads: Attention heads.

        Raises:
            ValueError: ``dim`` is not a multiple of ``heads``.
        """
        super().__init__()
        if dim % heads:
            raise ValueError(f"gpt dim ({dim}) must be a multiple of heads ({heads})")
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(b, T, dim)`` to ``(b, T, dim)``; a position attends to itself and earlier ones."""
        b, t, d = x.shape
        h = self.heads

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, h, d // h).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(
            split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        result: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, t, d))
        return result


class TransformerBlock(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))`` (GELU MLP)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        """Build the block.

        Args:
            dim: Model width.
            heads: Attention heads (a divisor of ``dim``).
            mlp_ratio: Hidden width of the MLP as a multiple of ``dim``.
        """
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, mlp_ratio * dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(b, T, dim)`` to ``(b, T, dim)``."""
        x = x + self.attn(self.ln1(x))
        result: torch.Tensor = x + self.proj(self.act(self.fc(self.ln2(x))))
        return result


class GPT(nn.Module):
    """Decoder-only language model: token and positional embeddings, pre-LN blocks, a head.

    Token + positional ``nn.Embedding``, pre-LN blocks, final LayerNorm, ``nn.Linear``
    head. Input: token indices ``(b, T)`` (int64, ``T`` ≤ ``context``); output: logits
    ``(b, T, vocab)`` for the next token at each position.

    The positional embedding is looked up with positions expanded to ``(b, T)``, so K-FAC
    sees one row per (example, position) for it as for the token embedding. LayerNorm
    parameters are not preconditioned (left to the optimizer).
    """

    def __init__(self, vocab: int, context: int, dim: int, depth: int, heads: int,
                 mlp_ratio: int) -> None:
        """Build the model; linear and embedding weights are drawn from N(0, 0.02²), biases zero.

        Args:
            vocab: Vocabulary size (inputs and outputs).
            context: The longest sequence.
            dim: Model width.
            depth: Transformer blocks.
            heads: Attention heads per block.
            mlp_ratio: Hidden width of each MLP as a multiple of ``dim``.
        """
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(
            [TransformerBlock(dim, heads, mlp_ratio) for _ in range(depth)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token indices ``(b, T)`` to next-token logits ``(b, T, vocab)``.

        Raises:
            ValueError: ``T`` exceeds the context.
        """
        idx = idx.long()
        b, t = idx.shape
        if t > self.context:
            raise ValueError(f"sequence length {t} exceeds the model's context {self.context}")
        positions = torch.arange(t, device=idx.device).expand(b, t)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        result: torch.Tensor = self.head(self.ln(x))
        return result


@register_model("gpt")
def _gpt(
    *,
    num_classes: int,
    in_channels: int,
    image_size: int | None,
    input_dim: int | None,
    dim: int = 64,
    depth: int = 2,
    heads: int = 4,
    mlp_ratio: int = 4,
    context: int | None = None,
) -> nn.Module:
    """Build a small decoder-only transformer.

    ``num_classes`` is the vocabulary (256: bytes), ``input_dim`` the sequence length
    (the default ``context``).
    """
    ctx = context if context is not None else input_dim
    if ctx is None or ctx < 1:
        raise ValueError("gpt needs a context length (context=, or input_dim = sequence length)")
    if min(dim, depth, heads, mlp_ratio) < 1:
        raise ValueError("gpt dim, depth, heads and mlp_ratio must be >= 1")
    return GPT(num_classes, int(ctx), int(dim), int(depth), int(heads), int(mlp_ratio))
