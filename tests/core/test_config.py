"""core.config: defaults ← YAML/TOML file ← command-line flags, with names and types checked."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from core.config import (
    DEVICES,
    ConfigError,
    add_options,
    explicit_args,
    from_cli,
    load_config_file,
    option,
    options_table,
    resolve_config,
    section,
    to_jsonable,
)
from index.build.config import BuildConfig


@dataclass
class Cfg:
    name: str = "default"
    k: int = 10
    ratio: float = 0.5
    flag: bool = False
    ks: list[int] = field(default_factory=lambda: [1, 2])
    sizes: tuple[int, ...] = (3,)
    limit: int | None = None
    params: dict[str, float] = field(default_factory=dict)


def test_defaults_when_no_layers():
    assert resolve_config(Cfg) == Cfg()
    assert resolve_config(Cfg, {}, {}) == Cfg()


def test_later_layers_win():
    cfg = resolve_config(Cfg, {"k": 1, "name": "file"}, {"k": 2}, {"ratio": 0.25})
    assert cfg.k == 2 and cfg.name == "file" and cfg.ratio == 0.25
    assert cfg.flag is False  # untouched options keep their defaults


def test_type_coercion():
    cfg = resolve_config(
        Cfg,
        {
            "name": 7,
            "k": "12",
            "ratio": "1e-3",
            "flag": "yes",
            "ks": "1, 4,16,",
            "sizes": [5, "6"],
            "limit": "3",
            "params": {"nprobe": 8},
        },
    )
    assert cfg.name == "7"
    assert cfg.k == 12 and isinstance(cfg.k, int)
    assert cfg.ratio == pytest.approx(0.001)
    assert cfg.flag is True
    assert cfg.ks == [1, 4, 16]
    assert cfg.sizes == (5, 6)
    assert cfg.limit == 3
    assert cfg.params == {"nprobe": 8}
    assert resolve_config(Cfg, {"k": 4.0}).k == 4
    assert resolve_config(Cfg, {"ratio": 2}).ratio == 2.0
    assert resolve_config(Cfg, {"limit": None}).limit is None
    for text, value in [("0", False), ("off", False), ("TRUE", True), ("no", False)]:
        assert resolve_config(Cfg, {"flag": text}).flag is value


@pytest.mark.parametrize(
    "layer, message",
    [
        ({"k": "ten"}, "k: expected int"),
        ({"k": 2.5}, "k: expected an integer"),
        ({"k": True}, "k: expected a number"),
        ({"ratio": "fast"}, "ratio: expected float"),
        ({"flag": "maybe"}, "flag: expected true or false"),
        ({"ks": 3}, "ks: expected a list"),
        ({"ks": ["a"]}, "ks: expected int"),
        ({"limit": "x"}, "limit: 'x' is not a valid"),
        ({"name": ["a"]}, "name: expected a string"),
        ({"params": [1]}, "params: expected a mapping"),
    ],
)
def test_bad_values(layer, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(Cfg, layer)


def test_unknown_options_are_named_with_the_known_ones():
    with pytest.raises(ConfigError, match="unknown option\\(s\\) colour, kk; known: flag, k, ks"):
        resolve_config(Cfg, {"k": 1}, {"kk": 2, "colour": "red"})


def test_real_config_class_and_its_own_validation():
    cfg = resolve_config(BuildConfig, {"factory": "IVF16,Flat", "ks": "1,10"}, {"batch_size": "64"})
    assert cfg.factory == "IVF16,Flat" and cfg.ks == [1, 10] and cfg.batch_size == 64
    assert cfg.catalog is None and cfg.max_recall_drop is None
    with pytest.raises(ValueError, match="must be positive"):
        resolve_config(BuildConfig, {"batch_size": 0})


# --- files --------------------------------------------------------------------------------------


def test_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("k: 3\nbatch-size: 64\nks: [1, 2, 4]\nparams:\n  nprobe: 4\n")
    assert load_config_file(path) == {"k": 3, "batch_size": 64, "ks": [1, 2, 4], "params": {"nprobe": 4}}
    yml = tmp_path / "run.yml"
    yml.write_text("flag: true\n")
    assert load_config_file(yml) == {"flag": True}
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"k": 5}))
    assert load_config_file(js) == {"k": 5}


def test_toml_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('name = "x"\nmax-bad-fraction = 0.5\nks = [1, 10]\n[params]\nnprobe = 16\n')
    assert load_config_file(path) == {
        "name": "x",
        "max_bad_fraction": 0.5,
        "ks": [1, 10],
        "params": {"nprobe": 16},
    }


def test_empty_yaml_is_no_options(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert load_config_file(path) == {}


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("bad.yaml", "k: [1, 2\n", "cannot parse"),
        ("bad.toml", "k = = 3\n", "cannot parse"),
        ("list.yaml", "- 1\n- 2\n", "expected a mapping"),
        ("scalar.yaml", "just a string\n", "expected a mapping"),
        ("run.ini", "k=1\n", "must be .yaml, .yml, .toml or .json"),
    ],
)
def test_bad_files(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config_file(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "none.yaml")


def test_from_cli_layers_file_under_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("k: 3\nname: from-file\nratio: 0.1\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--k", type=int, default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--flag", action="store_true", default=None)
    args = parser.parse_args(["--config", str(path), "--k", "7"])
    assert explicit_args(args) == {"k": 7}
    cfg = from_cli(Cfg, args)
    assert (cfg.k, cfg.name, cfg.ratio, cfg.flag) == (7, "from-file", 0.1, False)
    no_file = from_cli(Cfg, parser.parse_args(["--flag"]))
    assert no_file == Cfg(flag=True)


def test_to_jsonable():
    out = to_jsonable(Cfg(sizes=(1, 2)))
    assert out["sizes"] == [1, 2] and out["limit"] is None
    assert json.loads(json.dumps(out)) == out


# ---------------------------------------------------------------- options declared once


@dataclasses.dataclass
class Limits:
    max_k: int = option(100, help="most neighbours a query may ask for")
    strict: bool = option(False, help="refuse instead of clamping")


@dataclasses.dataclass
class Declared:
    name: str = option("x", help="a name")
    width: int | None = option(8, help="a width, or none")
    device: str = option("auto", choices=DEVICES, help="where it runs")
    ks: list[int] = option(default_factory=lambda: [1, 2], help="Ks")
    hidden: int = option(3, cli=False, help="files only")
    limits: Limits = section(Limits, help="limits")


def _parse(*argv: str) -> Declared:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_options(parser, Declared)
    return from_cli(Declared, parser.parse_args(list(argv)))


def test_flags_come_from_the_schema_and_nested_sections_stay_flat_on_the_command_line():
    cfg = _parse("--name", "y", "--max-k", "7", "--strict", "--ks", "1,5", "--device", "gpu")
    assert cfg == Declared(name="y", device="gpu", ks=[1, 5], limits=Limits(max_k=7, strict=True))
    assert _parse() == Declared()
    assert _parse("--no-strict").limits.strict is False


def test_none_on_the_command_line_unsets_an_optional_value():
    assert _parse("--width", "none").width is None


def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        _parse("--max-k", "many")
    assert "argument --max-k: expected int, got 'many'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse("--device", "cuda")
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


def test_a_config_file_may_nest_sections_or_name_options_flat(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text("name: file\nlimits:\n  max-k: 5\nhidden: 9\n")
    assert _parse("--config", str(nested)) == Declared(name="file", hidden=9, limits=Limits(max_k=5))
    flat = tmp_path / "flat.toml"
    flat.write_text('max_k = 6\ndevice = "cpu"\n')
    assert _parse("--config", str(flat), "--max-k", "4") == Declared(device="cpu", limits=Limits(max_k=4))
    bad = tmp_path / "bad.yaml"
    bad.write_text("device: tpu\n")
    with pytest.raises(ConfigError, match="device: 'tpu' is not one of auto, cpu, gpu"):
        _parse("--config", str(bad))


def test_options_only_in_files_have_no_flag_and_the_reference_lists_every_option():
    parser = argparse.ArgumentParser()
    add_options(parser, Declared)
    assert "--hidden" not in parser.format_help()
    table = options_table(Declared)
    for key in ("`name`", "`width`", "`limits.max_k`", "`limits.strict`", "`hidden`"):
        assert key in table
    assert "`--strict` / `--no-strict`" in table and "auto/cpu/gpu" in table and "`100`" in table


@dataclasses.dataclass
class Checked:
    max_batch_size: int = option(8, help="rows per batch")
    batch: int = option(4, flag="--batch-rows", help="spelled by its flag")
    limits: Limits = section(Limits, help="limits")

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        if self.batch_rows > self.max_batch_size:
            raise ValueError(f"batch_rows ({self.batch_rows}) must not exceed max_batch_size ({self.max_batch_size})")
        if self.limits.max_k < 1:
            raise ValueError(f"max_k must be at least 1, got {self.limits.max_k}")

    @property
    def batch_rows(self) -> int:
        return self.batch


def _checked(*argv: str) -> Checked:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_options(parser, Checked)
    return from_cli(Checked, parser.parse_args(list(argv)))


def test_a_checks_error_names_the_flag_the_user_typed_and_the_key_a_file_set(tmp_path):
    with pytest.raises(ConfigError) as caught:
        _checked("--max-batch-size", "0")
    assert str(caught.value) == "--max-batch-size must be at least 1, got 0"
    with pytest.raises(ValueError) as caught:
        _checked("--max-k", "0")  # an option of a section
    assert str(caught.value) == "--max-k must be at least 1, got 0"
    config = tmp_path / "run.yaml"
    config.write_text("max_batch_size: 0\nlimits:\n  max_k: 0\n")
    with pytest.raises(ValueError) as caught:
        _checked("--config", str(config))
    assert str(caught.value) == "max_batch_size must be at least 1, got 0"
    # each option as its own source spelled it: the flag where a flag set it, else the key
    config.write_text("max_batch_size: 2\n")
    with pytest.raises(ValueError) as caught:
        _checked("--config", str(config), "--batch-rows", "3")
    assert str(caught.value) == "--batch-rows (3) must not exceed max_batch_size (2)"
    # with no flags, a resolved configuration's errors are as its checks wrote them
    with pytest.raises(ValueError, match="^max_k must be at least 1, got 0$"):
        resolve_config(Checked, {"max_k": 0})
