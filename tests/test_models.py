"""The project's models: shapes, sizes, causality, the name registry."""

import pytest
import torch

from gossamer.train.models import (
    MODELS,
    CharTransformer,
    ResNet20,
    SmallCNN,
    build_model,
    is_sequence_model,
)


@pytest.mark.parametrize(
    "name, input_shape, num_classes, x, expected",
    [
        ("mlp", (64,), 10, torch.randn(5, 64), (5, 10)),
        ("cnn", (1, 28, 28), 10, torch.randn(5, 1, 28, 28), (5, 10)),
        ("resnet20", (3, 32, 32), 10, torch.randn(2, 3, 32, 32), (2, 10)),
        ("transformer", (16,), 11, torch.randint(0, 11, (3, 16)), (3, 16, 11)),
    ],
)
def test_output_shapes(name, input_shape, num_classes, x, expected):
    model = build_model(name, input_shape, num_classes)
    assert model(x).shape == expected


def test_models_tuple_and_sequence_flag():
    assert MODELS == ("mlp", "cnn", "resnet20", "transformer")
    assert [is_sequence_model(m) for m in MODELS] == [False, False, False, True]


def test_smallcnn_on_other_image_sizes():
    assert SmallCNN((3, 32, 32), 7)(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ValueError, match="input_shape"):
        SmallCNN((28, 28), 10)


def test_resnet20_parameter_count():
    n = sum(p.numel() for p in ResNet20().parameters())
    assert 250_000 <= n <= 300_000
    # option A shortcuts are parameter-free: every conv is a 3x3 one
    assert all(m.kernel_size == (3, 3) for m in ResNet20().modules()
               if isinstance(m, torch.nn.Conv2d))


def test_resnet20_downsamples_to_64_channels():
    model = ResNet20()
    features = model.blocks(model.conv(torch.randn(1, 3, 32, 32)))
    assert features.shape == (1, 64, 8, 8)


def test_transformer_is_causal():
    torch.manual_seed(0)
    model = CharTransformer(vocab_size=13, block_size=12, n_layer=2, n_head=4, n_embd=32).eval()
    x = torch.randint(0, 13, (2, 12))
    t = 7
    changed = x.clone()
    changed[:, t] = (x[:, t] + 1) % 13
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_transformer_rejects_too_long_input():
    model = CharTransformer(vocab_size=5, block_size=4)
    with pytest.raises(ValueError, match="block_size=4"):
        model(torch.zeros(1, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="n_head"):
        CharTransformer(vocab_size=5, block_size=4, n_embd=30, n_head=4)


def test_build_model_options():
    model = build_model("transformer", (8,), 20, n_layer=1, n_embd=16, n_head=2)
    assert len(model.blocks) == 1 and model.token_embedding.weight.shape == (20, 16)
    mlp = build_model("mlp", (64,), 10, hidden=(32, 16))
    assert mlp(torch.randn(2, 64)).shape == (2, 10)
    with pytest.raises(ValueError, match="takes no option 'depth'"):
        build_model("cnn", (1, 28, 28), 10, depth=3)


def test_build_model_unknown_name():
    with pytest.raises(ValueError, match=r"model 'vgg' is unknown; known: mlp, cnn, resnet20"):
        build_model("vgg", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="unknown"):
        is_sequence_model("vgg")
