"""The run manifest: presets, TOML run files over a preset, presets printed as run files, protobuf round trips,
field-named errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from crowdtrain import proto
from crowdtrain.errors import BadInputError
from crowdtrain.manifest import (
    PRESETS,
    PROTOCOL_VERSION,
    AveragingSpec,
    DataSpec,
    DiLoCoSpec,
    ModelSpec,
    OptimizerSpec,
    RunManifest,
    SkipPipeSpec,
    TrainingSpec,
    demo,
    llama_85m,
    load_run_file,
    manifest_from_overrides,
    preset_run_file,
    skippipe_demo,
    spes_demo,
)
from crowdtrain.models import spec_parameter_count
from crowdtrain.structured import FieldError


def write_run_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_demo_round_trips_through_protobuf() -> None:
    manifest = dataclasses.replace(demo(), created_at=1_700_000_000.25)
    data = manifest.to_bytes()
    assert RunManifest.from_bytes(data) == manifest
    assert manifest.to_bytes() == data  # deterministic: the founder's signature covers these bytes


def test_round_trip_keeps_every_spec_field() -> None:
    manifest = RunManifest(
        run_id="r.1_x-2",
        model=ModelSpec(
            architecture="AlbertForMaskedLM",
            config={"nested": {"a": [1, 2.5, None]}},
            tokenizer="/tok",
            precision="bf16",
        ),
        data=DataSpec(source="files", path="/data/corpus", text_field="body", sequence_length=512),
        optimizer=OptimizerSpec(name="sgd", learning_rate=0.5, weight_decay=0.0, warmup_steps=0, total_steps=3),
        target_batch_size=4096,
        training=TrainingSpec(mode="parameters"),
        averaging=AveragingSpec(group_size=4, grid_dims=8, compression="none", timeout_s=2.5),
    )
    assert RunManifest.from_bytes(manifest.to_bytes()) == manifest


def test_demo_preset_loads_by_name() -> None:
    assert load_run_file("demo") == demo()
    assert load_run_file("demo", run_id="other-run") == dataclasses.replace(demo(), run_id="other-run")


def test_run_file_overrides_only_what_it_names(tmp_path: Path) -> None:
    path = write_run_file(tmp_path, 'run_id = "mine"\n[optimizer]\nlearning_rate = 0.01\n')
    manifest = load_run_file(path)
    assert manifest.run_id == "mine"
    assert manifest.optimizer.learning_rate == 0.01
    assert manifest.optimizer == dataclasses.replace(demo().optimizer, learning_rate=0.01)
    assert dataclasses.replace(manifest, run_id="demo", optimizer=demo().optimizer) == demo()


def test_run_id_argument_beats_the_run_file(tmp_path: Path) -> None:
    path = write_run_file(tmp_path, 'run_id = "mine"\n')
    assert load_run_file(path, run_id="flagged").run_id == "flagged"


def test_integer_is_accepted_for_a_float_field(tmp_path: Path) -> None:
    manifest = load_run_file(write_run_file(tmp_path, "[optimizer]\nlearning_rate = 1\n"))
    assert manifest.optimizer.learning_rate == 1.0 and isinstance(manifest.optimizer.learning_rate, float)


def test_model_config_in_a_run_file_replaces_the_presets(tmp_path: Path) -> None:
    path = write_run_file(tmp_path, "[model.config]\nhidden_size = 64\n")
    assert load_run_file(path).model.config == {"hidden_size": 64}


def test_new_architecture_with_its_config_is_accepted(tmp_path: Path) -> None:
    path = write_run_file(tmp_path, '[model]\narchitecture = "GPT2LMHeadModel"\nconfig = { n_layer = 2 }\n')
    model = load_run_file(path).model
    assert model.architecture == "GPT2LMHeadModel"
    assert model.config == {"n_layer": 2}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[optimizer]\nlearnig_rate = 1\n", "optimizer.learnig_rate"),
        ("colour = 1\n", "colour"),
        ('target_batch_size = "big"\n', "target_batch_size"),
        ("[optimizer]\nwarmup_steps = 1.5\n", "optimizer.warmup_steps"),
        ('[model]\ntokenizer = ["a"]\n', "model.tokenizer"),
        ('model = "llama"\n', "model"),
        ('[training]\nmode = "magic"\n', "mode"),
        ("[averaging]\ngroup_size = 1\n", "group_size"),
        ("[data]\nsequence_length = 0\n", "sequence_length"),
        ('[data]\nsource = "files"\n', "path"),
        ("[optimizer]\nlearning_rate = -1.0\n", "learning_rate"),
        ('run_id = "Bad Run!"\n', "run_id"),
        ("run_id = 7\n", "run_id"),
        ("protocol_version = 99\n", "protocol_version"),
        ('[model]\narchitecture = "not a class"\nconfig = {}\n', "architecture"),
    ],
)
def test_bad_run_file_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = write_run_file(tmp_path, text)
    with pytest.raises(BadInputError, match=field.replace(".", r"\.")) as caught:
        load_run_file(path)
    assert path in str(caught.value)


def test_errors_say_which_table(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"\[training\].*mode.*'magic'"):
        load_run_file(write_run_file(tmp_path, '[training]\nmode = "magic"\n'))
    with pytest.raises(BadInputError, match=r"\[averaging\].*group_size"):
        load_run_file(write_run_file(tmp_path, "[averaging]\ngroup_size = 3\n"))


def test_a_run_file_with_the_old_averaging_mode_loads_and_says_what_to_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = load_run_file(write_run_file(tmp_path, '[averaging]\nmode = "diloco"\ngroup_size = 4\n'))
    assert (old.training.mode, old.averaging.group_size) == ("diloco", 4)
    assert [record.getMessage() for record in caplog.records] == [
        "run file: averaging.mode is now training.mode; write [training] mode = 'diloco' instead"
    ]
    with pytest.raises(BadInputError, match="set the mode once, as training.mode"):
        load_run_file(write_run_file(tmp_path, '[training]\nmode = "spes"\n[averaging]\nmode = "diloco"\n'))


def test_bad_run_id_argument_with_a_run_file_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="run_id"):
        load_run_file(write_run_file(tmp_path, ""), run_id="Bad Run!")


def test_bad_run_id_argument_with_a_preset_is_bad_input() -> None:
    with pytest.raises(BadInputError, match="run_id"):
        load_run_file("demo", run_id="Bad Run!")


def test_changing_architecture_without_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="model.config"):
        load_run_file(write_run_file(tmp_path, '[model]\narchitecture = "GPT2LMHeadModel"\n'))
    with pytest.raises(FieldError, match="model.config"):
        manifest_from_overrides({"model": {"architecture": "GPT2LMHeadModel"}})


def test_invalid_toml_is_bad_input(tmp_path: Path) -> None:
    path = write_run_file(tmp_path, "[optimizer\nlearning_rate = \n")
    with pytest.raises(BadInputError, match="not valid TOML") as caught:
        load_run_file(path)
    assert path in str(caught.value)


def test_a_directory_is_not_a_run_file(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match="Cannot read run file") as caught:
        load_run_file(str(tmp_path))
    assert str(tmp_path) in str(caught.value)


def test_a_missing_file_that_is_no_preset_is_bad_input(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(BadInputError, match="neither a file nor a preset") as caught:
        load_run_file(missing)
    assert missing in str(caught.value) and "demo" in str(caught.value)


def test_run_file_that_is_not_utf8_is_bad_input(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_bytes(b'run_id = "\xff\xfe"\n')
    with pytest.raises(BadInputError, match="Cannot read run file"):
        load_run_file(str(path))


def test_protocol_version_mismatch_from_bytes_is_rejected() -> None:
    message = proto.RunManifest.FromString(demo().to_bytes())
    message.protocol_version = PROTOCOL_VERSION + 1
    with pytest.raises(ValueError, match="protocol_version.*upgrade crowdtrain"):
        RunManifest.from_bytes(message.SerializeToString())
    message.protocol_version = PROTOCOL_VERSION - 1  # a run an older release started
    with pytest.raises(ValueError, match="protocol_version.*release the run was started with"):
        RunManifest.from_bytes(message.SerializeToString())


def test_unknown_protobuf_fields_are_ignored() -> None:
    extra_field = b"\xa0\x06\x01"  # field 100, varint 1: a field a newer version might add
    assert RunManifest.from_bytes(demo().to_bytes() + extra_field) == demo()


@pytest.mark.parametrize("config_json", ["[1, 2]", "{not json", '"text"'])
def test_model_config_from_bytes_must_be_a_json_object(config_json: str) -> None:
    message = proto.RunManifest.FromString(demo().to_bytes())
    message.model.config_json = config_json
    with pytest.raises(FieldError, match="config"):
        RunManifest.from_bytes(message.SerializeToString())


def test_invalid_values_from_bytes_name_the_field() -> None:
    message = proto.RunManifest.FromString(demo().to_bytes())
    message.averaging.group_size = 1
    with pytest.raises(FieldError, match="group_size must be at least 2"):
        RunManifest.from_bytes(message.SerializeToString())


def test_corrupt_bytes_raise_value_error_as_documented() -> None:
    with pytest.raises(ValueError, match="not a RunManifest"):
        RunManifest.from_bytes(b"\xff\xff\xff")


def test_oversized_model_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="config is larger"):
        ModelSpec(config={"blob": "x" * 17_000})


def test_precision_defaults_to_auto_and_is_read_from_a_run_file(tmp_path: Path) -> None:
    assert demo().model.precision == "auto"
    manifest = load_run_file(write_run_file(tmp_path, '[model]\nprecision = "fp16"\n'))
    assert manifest.model.precision == "fp16" and manifest.model.config == demo().model.config


def test_unknown_precision_is_named(tmp_path: Path) -> None:
    with pytest.raises(BadInputError, match=r"\[model\]: precision must be one of auto, fp32, bf16, fp16"):
        load_run_file(write_run_file(tmp_path, '[model]\nprecision = "int8"\n'))


def test_a_manifest_from_a_node_without_precision_reads_as_auto() -> None:
    founder = dataclasses.replace(demo(), model=dataclasses.replace(demo().model, precision="bf16"))
    message = proto.RunManifest.FromString(founder.to_bytes())
    message.model.ClearField("precision")  # what an older node, whose proto has no such field, sends
    assert RunManifest.from_bytes(message.SerializeToString()) == demo()


def test_an_invalid_precision_from_bytes_names_the_field() -> None:
    message = proto.RunManifest.FromString(demo().to_bytes())
    message.model.precision = ""
    with pytest.raises(FieldError, match="precision must be one of"):
        RunManifest.from_bytes(message.SerializeToString())


@pytest.mark.parametrize(
    "name, low, high",
    [("llama-20m", 15e6, 30e6), ("llama-85m", 84e6, 86e6), ("llama-350m", 330e6, 370e6)],
)
def test_real_size_presets_have_their_parameter_counts_and_round_trip(name: str, low: float, high: float) -> None:
    manifest = load_run_file(name)
    assert low <= spec_parameter_count(manifest.model, 260) <= high  # on the meta device: nothing allocated
    assert manifest.run_id == name and manifest.data.source == "embedded"
    assert manifest.model.config["max_position_embeddings"] >= manifest.data.sequence_length
    assert RunManifest.from_bytes(manifest.to_bytes()) == manifest


def test_every_preset_round_trips_through_protobuf() -> None:
    for build in PRESETS.values():
        assert RunManifest.from_bytes(build().to_bytes()) == build()


def test_diloco_overlap_defaults_on_reads_from_a_run_file_and_an_older_nodes_manifest_means_on(tmp_path: Path) -> None:
    assert DiLoCoSpec().overlap
    text = '[training]\nmode = "diloco"\n[diloco]\ninner_steps = 4\noverlap = false\n'
    manifest = load_run_file(write_run_file(tmp_path, text))
    assert manifest.diloco is not None and not manifest.diloco.overlap
    assert RunManifest.from_bytes(manifest.to_bytes()) == manifest
    message = proto.RunManifest.FromString(manifest.to_bytes())
    message.diloco.ClearField("overlap")  # what a node whose proto has no such field sends
    loaded = RunManifest.from_bytes(message.SerializeToString())
    assert loaded.diloco is not None and loaded.diloco.overlap
    with pytest.raises(BadInputError, match="overlap"):
        load_run_file(write_run_file(tmp_path, text.replace("false", '"no"')))


def test_a_run_file_extends_the_preset_it_names(tmp_path: Path) -> None:
    manifest = load_run_file(write_run_file(tmp_path, 'preset = "llama-85m"\ntarget_batch_size = 2048\n'))
    assert manifest == dataclasses.replace(llama_85m(), target_batch_size=2048)
    assert manifest.model.config["hidden_size"] == 768 and manifest.model != demo().model


def test_a_run_file_on_a_preset_merges_its_tables_and_replaces_its_model_config(tmp_path: Path) -> None:
    text = 'preset = "spes-demo"\n[diloco]\ninner_steps = 40\n[model.config]\nhidden_size = 64\n'
    manifest = load_run_file(write_run_file(tmp_path, text))
    assert manifest.diloco == DiLoCoSpec(inner_steps=40, compression="fp16", overlap=False)  # spes-demo's, but H
    assert manifest.spes == spes_demo().spes and manifest.model.architecture == "OlmoeForCausalLM"
    assert manifest.model.config == {"hidden_size": 64}


def test_naming_the_demo_preset_is_the_same_as_naming_none(tmp_path: Path) -> None:
    assert load_run_file(write_run_file(tmp_path, 'preset = "demo"\n')) == demo()  # `preset` is no manifest field
    assert manifest_from_overrides({"preset": "skippipe-demo"}) == skippipe_demo()


def test_changing_a_presets_architecture_without_config_names_the_preset(tmp_path: Path) -> None:
    text = 'preset = "spes-demo"\n[model]\narchitecture = "LlamaForCausalLM"\n'
    with pytest.raises(BadInputError, match=r"model\.config is required .* the spes-demo preset's"):
        load_run_file(write_run_file(tmp_path, text))


@pytest.mark.parametrize("value", ['"llama-86m"', "3", '["demo"]'])
def test_an_unknown_preset_is_one_sentence_naming_the_presets(tmp_path: Path, value: str) -> None:
    path = write_run_file(tmp_path, f"preset = {value}\n[optimizer]\nlearning_rate = 0.01\n")
    with pytest.raises(BadInputError, match="unknown preset") as caught:
        load_run_file(path)
    message = str(caught.value)
    assert path in message and "\n" not in message and message.endswith(").")
    assert all(name in message for name in PRESETS)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_printed_as_a_run_file_loads_back_equal(tmp_path: Path, name: str) -> None:
    text = preset_run_file(name)
    tables = tomllib.loads(text)
    assert next(iter(tables.items())) == ("preset", name)
    assert "protocol_version" not in tables and "created_at" not in tables
    assert tables["model"]["config"] == PRESETS[name]().model.config  # complete, not left to the preset
    assert load_run_file(write_run_file(tmp_path, text)) == PRESETS[name]()


def test_a_printed_preset_leaves_out_none_and_loads_it_back_as_none(tmp_path: Path) -> None:
    text = preset_run_file("spes-demo")
    tables = tomllib.loads(text)
    assert "moe" not in tables and "skippipe" not in tables  # None sections: TOML has no null
    assert "min_inner_steps" not in tables["diloco"] and "max_inner_steps" not in tables["diloco"]
    edited = text.replace("inner_steps = 20\n", "inner_steps = 30\n")
    manifest = load_run_file(write_run_file(tmp_path, edited))
    assert manifest.diloco is not None and manifest.diloco.inner_steps == 30
    assert manifest.diloco.min_inner_steps is None and manifest.moe is None and manifest.skippipe is None


def test_the_preset_command_prints_a_run_file_that_loads_back_equal(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "crowdtrain", "preset", "skippipe-demo"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    assert load_run_file(write_run_file(tmp_path, result.stdout)) == skippipe_demo()
    listing = subprocess.run(command[:-1], capture_output=True, text=True, timeout=120, check=True).stdout
    for name, build in PRESETS.items():
        assert any(line.split()[:1] == [name] and build.__doc__.split("\n")[0] in line for line in listing.splitlines())


def test_a_skippipe_run_with_sgd_is_refused(tmp_path: Path) -> None:
    text = 'preset = "skippipe-demo"\n[optimizer]\nname = "sgd"\n'
    with pytest.raises(BadInputError, match="SkipPipe.*AdamW.*optimizer.name must be 'adamw', not 'sgd'"):
        load_run_file(write_run_file(tmp_path, text))
    with pytest.raises(ValueError, match="optimizer.name"):
        dataclasses.replace(skippipe_demo(), optimizer=OptimizerSpec(name="sgd"))
    assert dataclasses.replace(demo(), optimizer=OptimizerSpec(name="sgd")).optimizer.name == "sgd"
    assert dataclasses.replace(skippipe_demo(), skippipe=SkipPipeSpec(stages=2)).optimizer.name == "adamw"
