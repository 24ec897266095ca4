"""``repeated:``: another source's text cut into passages, each written again, read wherever a spec is taken."""

import types

import pytest

from hf_normswap.data import DataError, check_spec, load_texts
from hf_normswap.data.sources import Repeated, source
from hf_normswap.training import recipe_data, recipe_settings
from tiny_models import tiny_tokenizer

WORDS = [f"w{i}" for i in range(7)]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text(" ".join(WORDS[:4]) + "\n\n" + " ".join(WORDS[4:]) + "\n")
    return path


def test_passages_of_n_words_each_written_k_times(text_file):
    assert load_texts(f"repeated:words=3,copies=3:{text_file}") == [
        "w0 w1 w2\nw0 w1 w2\nw0 w1 w2", "w3 w4 w5\nw3 w4 w5\nw3 w4 w5", "w6\nw6\nw6"]
    assert load_texts(f"repeated:{text_file}") == ["\n".join([" ".join(WORDS)] * 2)]  # 150 words, twice
    assert type(source(f"repeated:{text_file}")) is Repeated and check_spec(f"repeated:{text_file}") == [text_file]


@pytest.mark.parametrize("spec, problem", [
    ("repeated:words=0:builtin", "'words=0' is not a setting"),
    ("repeated:copies=1:builtin", "'copies=1' is not a setting"),
    ("repeated:times=2:builtin", "'times=2' is not a setting"),
    ("repeated:", "no text to repeat"),
    ("repeated:generated", "not the original's samples"),
])
def test_a_bad_setting_is_one_line_naming_the_form(spec, problem):
    with pytest.raises(DataError, match=problem) as raised:
        check_spec(spec)
    assert "\n" not in str(raised.value)


def test_a_missing_file_is_refused_by_the_check(tmp_path):
    with pytest.raises(DataError):
        check_spec(f"repeated:{tmp_path / 'absent.txt'}")


def test_the_recipe_trains_on_it_mixed_with_another_source(text_file, tmp_path):
    """Its rows hold each passage's tokens twice in a row (EOS between passages), mixed with builtin text."""
    spec = f"repeated:words=3:{text_file}"
    config = recipe_settings.load_config([f"train_data=[{spec}, builtin]", "eval_data=builtin:evaluation",
                                          "block_len=8", f"output_dir={tmp_path / 'run'}"])
    recipe_data.check_data(config, calibrates=False)
    tokenizer = tiny_tokenizer()
    state = types.SimpleNamespace(process_index=0, num_processes=1)
    rows = recipe_data.training_stream(spec, None, 8, 0, tokenizer, None, state)["input_ids"]
    stream = [t for row in rows for t in row]
    passage = tokenizer("w0 w1 w2", add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert stream[:2 * len(passage) + len(newline)] == passage + newline + passage
