"""The one default for target layers and the rules every layer choice follows."""

import pytest

from dflash.extract import config as extract_config
from dflash.shared.layers import check_layer_ids, default_layer_ids


def test_recipe_layers_of_real_targets():
    # DFlash's published choice for 36-layer Qwen3-4B/8B, and the same rule on 28 layers
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(28) == [1, 7, 13, 19, 25]


@pytest.mark.parametrize("L,want", [
    (2, [0]), (3, [0, 1]), (4, [0, 1, 2]), (5, [0, 1, 2, 3]), (6, [0, 1, 2, 3, 4]),
    (7, [0, 1, 3, 4, 5]), (8, [1, 2, 3, 4, 5]),
])
def test_small_targets(L, want):
    """Below 8 layers 1..L-3 holds fewer than 5: every capturable layer 0..L-2 is used."""
    assert default_layer_ids(L) == want


def test_one_layer_target_has_no_layer_to_read():
    with pytest.raises(ValueError, match="no layer a drafter can read"):
        default_layer_ids(1)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
def test_sweep_over_target_depths(count):
    for L in range(2, 200):
        ids = default_layer_ids(L, count)
        check_layer_ids(ids, L)  # the default always passes the rules
        assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < L - 1
        capturable = L - 1
        assert len(ids) == min(count, capturable)
        if L - 3 >= count and count > 1:  # the recipe's range, both ends included, evenly spread
            assert ids[0] == 1 and ids[-1] == L - 3
            exact = [1 + j * (L - 4) / (count - 1) for j in range(count)]
            assert all(abs(i - x) <= 0.5 for i, x in zip(ids, exact))


def test_extraction_and_training_share_the_default():
    assert extract_config.default_layer_ids is default_layer_ids


@pytest.mark.parametrize("ids,needle", [
    ([0, 3], "3 is the last layer (L-1)"),
    ([2, 0], "not in ascending order"),
    ([0, 1, 1], "[1] repeated"),
    ([0, 4], "[4] outside 0..3"),
    ([-1, 0], "[-1] outside 0..3"),
    ([], "no layer given"),
])
def test_check_names_each_problem_and_why(ids, needle):
    with pytest.raises(ValueError) as info:
        check_layer_ids(ids, 4)
    text = str(info.value)
    assert needle in text
    assert "input of decoder layer i + 1" in text and "ascending order" in text


def test_check_accepts_valid_ids():
    check_layer_ids([0, 1, 2], 4)
    check_layer_ids([1, 9, 17, 25, 33], 36)
    check_layer_ids([34], 36)


@pytest.mark.parametrize("layers", [[0, 3], [2, 1], [1, 1]])
def test_extraction_refuses_layers_with_the_same_message(layers, tiny_target_dir, chats_sample_path, tmp_path):
    from dflash.extract.runner import ExtractFailed, run
    from dflash.extract.plan import plan_run

    out = tmp_path / "cache.zarr"
    cfg = extract_config.ExtractConfig(data=str(chats_sample_path), model=str(tiny_target_dir), out=str(out),
                                       device="cpu", layers=layers, progress=False)
    with pytest.raises(ValueError) as reference:
        check_layer_ids(layers, 4)
    with pytest.raises(ExtractFailed) as info:
        run(cfg)
    assert str(info.value) == f"--layers: {reference.value}"
    assert not out.exists()  # refused before the cache root was made
    with pytest.raises(ExtractFailed) as planned:  # --plan refuses them with the run's message
        plan_run(cfg)
    assert str(planned.value) == str(info.value)


def test_extraction_default_is_the_shared_one(tiny_target_dir, chats_sample_path, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from dflash.extract.data import load_source
    from dflash.extract.runner import build_spec

    cfg = extract_config.ExtractConfig(data=str(chats_sample_path), model=str(tiny_target_dir),
                                       out=str(tmp_path / "c.zarr"), device="cpu")
    model_config = AutoConfig.from_pretrained(tiny_target_dir)
    spec = build_spec(cfg, AutoTokenizer.from_pretrained(tiny_target_dir), model_config,
                      load_source(cfg.data, "train"), num_shards=1)
    assert spec.layer_ids == default_layer_ids(model_config.num_hidden_layers) == [0, 1, 2]
    assert spec.fingerprint["extraction"]["layers"] == spec.layer_ids
    assert spec.info["target_path"] == str(tiny_target_dir.resolve())  # where training finds the target
