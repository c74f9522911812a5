"""The mechanism study: when does the embedding-based penalty appear? The main job once per knob level.

A file names a main-job experiment (``base``: its keys, as a file without ``study:`` has them) and knobs, each moved
alone from the base toward the paper's setting by overrides (``model.decoder_width=96``: the same KEY=VALUE texts
``run_pipeline.py`` takes, with the same checks). Every setting, the base and each knob level, is a main job whose
report lands in ``settings/<setting>/``; their stage folders share the study's folder, so a stage two settings share
(the same parameters: the base's centralized models under a federated knob, say) runs once. The study's report
reads each setting's answer (report_paper.csv), positive control (report_control.csv) and iid reference
(report_iid.csv) for every task × algorithm, and says in one sentence under which knob levels the penalty appears.

Layout under ``results/<name>/``: the shared stage folders (pipeline/studies/main_job/runner.py), ``settings/<setting>/``
(each setting's main-job report), ``report.md``, ``report.csv``, ``mechanism.png`` (mechanism_report.py), ``config.json``,
``run.log``.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.checks import check_input_files
from pipeline.overrides import apply_overrides, parse_overrides
from pipeline.schema import ListOf, Mapping, Str, check_types
from pipeline.sections import check_run_count, merge_keys
from pipeline.studies.main_job import config as main_config
from pipeline.studies.main_job import runner as main_runner
from pipeline.studies.main_job.mechanism_report import BASE_SETTING, mechanism_table, setting_dir, write_report
from pipeline.studies.registry import MAIN_JOB, StudyKind, register
from utils.errors import TaskHetError
from utils.run_dir import write_config

if TYPE_CHECKING:
    import pandas as pd

NAME = "mechanism"
SCHEMA: dict[str, Any] = {"study": NAME, "name": NAME, "base": {}, "knobs": []}
FREE_FORM = frozenset({"base", "knobs"})  # checked here, key by key, not by the generic merge
TYPES: dict[str, Any] = {}  # filled below, once check_knobs is defined
HELP = {
    "study": "the kind of study this file is: mechanism",
    "name": "the results folder's name (results/<name>/)",
    "base": "a main-job experiment (the keys of a file without study:): the setting every knob starts from",
    "knobs": "the knobs, each moved alone: a list of {name, base_level, levels: [{label, set: [KEY=VALUE, ...]}]}; "
             "set holds run_pipeline.py's overrides of the base, which meet the main job's checks",
}
KNOB_KEYS = {"name", "base_level", "levels"}
LEVEL_KEYS = {"label", "set"}

# ----- the file -----
def load(raw: dict[str, Any], source: Path) -> dict[str, Any]:
    """Merge and check a mechanism file, and validate every setting as the main job it will run (errors name the
    knob, the level and the override). Returns the config with ``settings``: the base first, then every knob level
    in file order, each ``{knob, level, slug, overrides, config}``."""
    config = merge_keys(copy.deepcopy(SCHEMA), raw, source, FREE_FORM)
    check_types(config, source, TYPES)
    knobs = config["knobs"]
    base = {key: value for key, value in config["base"].items() if key != "study"}
    settings = [{"knob": BASE_SETTING, "level": BASE_SETTING, "slug": BASE_SETTING, "overrides": [],
                 "config": main_setting(base, [], source, "base")}]
    for index, knob in enumerate(knobs):
        for level in knob["levels"]:
            where = f"knobs[{index}] ({knob['name']}), level {level['label']}"
            settings.append({"knob": knob["name"], "level": level["label"], "slug": setting_slug(knob["name"], level["label"]),
                             "overrides": level["set"], "config": main_setting(base, level["set"], source, where)})
    # every setting is a whole main job: the map's runs together meet the one limit a file has
    check_run_count(sum(main_config.count_combinations(setting["config"]) for setting in settings), source,
                    "the settings' main jobs together (the base and every knob level)")
    accelerators = {setting["config"]["use_accelerator"] for setting in settings}
    if len(accelerators) > 1:
        raise TaskHetError(f"{source}: knobs: a knob sets use_accelerator; every setting runs on the same executor")
    slugs = [setting["slug"] for setting in settings]
    repeated = sorted({slug for slug in slugs if slugs.count(slug) > 1})
    if repeated:
        raise TaskHetError(f"{source}: knobs: two settings share the folder name {repeated[0]!r}; give the knobs or "
                           "levels names that differ in more than case and punctuation")
    # the executor is opened once for every setting (run_pipeline.py reads this key)
    return {**config, "knobs": knobs, "settings": settings, "use_accelerator": accelerators.pop()}


def check_knobs(knobs: Any, key: str = "knobs") -> list[dict[str, Any]]:
    """The knobs list, each ``{name, base_level, levels: [{label, set}]}`` with its keys and types checked (a
    :data:`pipeline.schema.Check`: errors name the key; a number as a level's label becomes its text)."""
    if not isinstance(knobs, list) or not knobs:
        raise TaskHetError(f"{key} must list at least one knob, e.g. [{{name: decoder width, base_level: '32', "
                           f"levels: [{{label: '96', set: [model.decoder_width=96]}}]}}], got {knobs!r}")
    checked, names = [], set()
    for index, knob in enumerate(knobs):
        where = f"{key}[{index}]"
        _require_keys(knob, KNOB_KEYS, where)
        name = Str()(knob["name"], f"{where}.name")
        if name in names:
            raise TaskHetError(f"{where}.name {name!r} names a knob twice")
        names.add(name)
        base_level = Str()(_label_text(knob["base_level"]), f"{where}.base_level")
        if not isinstance(knob["levels"], list) or not knob["levels"]:
            raise TaskHetError(f"{where}.levels must list at least one level {{label, set}}, got {knob['levels']!r}")
        levels, labels = [], {base_level}
        for position, level in enumerate(knob["levels"]):
            level_key = f"{where}.levels[{position}]"
            _require_keys(level, LEVEL_KEYS, level_key)
            label = Str()(_label_text(level["label"]), f"{level_key}.label")
            if label in labels:
                raise TaskHetError(f"{level_key}.label {label!r} repeats a level of knob {name!r} (its base level is "
                                   f"{base_level!r})")
            labels.add(label)
            levels.append({"label": label, "set": ListOf(Str())(level["set"], f"{level_key}.set")})
        checked.append({"name": name, "base_level": base_level, "levels": levels})
    return checked


def _label_text(value: Any) -> Any:
    """A level written as a YAML number (``base_level: 32``) is its text; anything else is checked as it is."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _require_keys(value: Any, keys: set[str], where: str) -> None:
    if not isinstance(value, dict):
        raise TaskHetError(f"{where} must be a mapping with the keys {', '.join(sorted(keys))}, got {value!r}")
    if set(value) != keys:
        missing, unknown = sorted(keys - set(value)), sorted(set(value) - keys)
        problem = f"lacks {', '.join(missing)}" if missing else f"has the unknown key(s) {', '.join(unknown)}"
        raise TaskHetError(f"{where} {problem}; a knob has {', '.join(sorted(keys))}")


@dataclass(frozen=True)
class KnobList:
    """The ``knobs`` key's check (a :data:`pipeline.schema.Check`), with the words the reference page prints."""

    description: str = "a list (at least 1) of {name, base_level, levels: [{label, set: [KEY=VALUE, ...]}]}"

    def __call__(self, value: Any, key: str) -> list[dict[str, Any]]:
        return check_knobs(value, key)


TYPES.update({
    "study": Str(),
    "name": Str(plain=True),
    "base": Mapping(what="hold a main-job experiment's keys", example="{tasks: [edge_texture], partition: {...}, ...}"),
    "knobs": KnobList(),
})


def main_setting(base: dict[str, Any], overrides: list[str], source: Path, where: str) -> dict[str, Any]:
    """The validated main-job config of ``base`` with ``overrides`` applied (errors name ``where``)."""
    try:
        parsed = parse_overrides(overrides)
        raw = apply_overrides(copy.deepcopy(base), parsed, main_config.SCHEMA, main_config.FREE_FORM)
        config = main_config.load(raw, source)
    except TaskHetError as error:
        raise TaskHetError(f"{where}: {error}") from None
    config["study"] = MAIN_JOB
    config["overrides"] = list(overrides)
    return config


def setting_slug(knob: str, level: str) -> str:
    """A setting's folder name: ``decoder_width-96`` (letters, digits, ``.`` and ``_``; the rest becomes ``_``)."""
    def plain(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_").lower() or "x"
    return f"{plain(knob)}-{plain(level)}"


# ----- the run -----
def run(pipeline) -> pd.DataFrame:
    """Every setting's main job, one after another, with their stages in the study's folder; then the report."""
    config, out_dir = pipeline.config, pipeline.out_dir
    settings = config["settings"]
    for setting in settings:
        check_input_files(setting["config"])
    if pipeline.record is not None:
        write_config(out_dir, pipeline.record)
        pipeline.log(f"started: {pipeline.command}")
    started = time.monotonic()
    for number, setting in enumerate(settings, 1):
        line = f"setting {number} of {len(settings)}: {describe(setting)}"
        print(line, flush=True)
        pipeline.log(line)
        # run_pipeline.py's --tensorboard and --run_plots set these keys of the study's config: each setting takes them
        flags = {key: config[key] for key in ("tensorboard", "run_plots") if key in config}
        sub = replace(pipeline, config={**setting["config"], **flags}, out_dir=setting_dir(out_dir, setting),
                      progress=None, record=None, stages_dir=pipeline.stage_root)
        main_runner.run(sub)
        elapsed = time.monotonic() - started
        left = elapsed / number * (len(settings) - number)  # settings differ in cost: a rough guide
        done = f"setting {number} of {len(settings)} done: {elapsed / 60:.1f} min elapsed, ETA {left / 60:.0f} min"
        print(done, flush=True)
        pipeline.log(done)
    if not pipeline.writes_report:  # a shard: its share of every setting's runs is done; the final call reports
        return pd.DataFrame()
    table = mechanism_table(config, out_dir)
    write_report(config, out_dir, table, pipeline.command)
    return table


def describe(setting: dict[str, Any]) -> str:
    if setting["knob"] == BASE_SETTING:
        return "the base"
    return f"{setting['knob']} = {setting['level']} ({', '.join(setting['overrides'])})"





register(StudyKind(
    name=NAME,
    summary="the main job once per knob level, each knob moved alone toward the paper's setting: when the "
            "embedding-based penalty appears",
    schema=SCHEMA,
    load=load,
    run=run,
    report_unit="setting × task × algorithm rows",
    free_form=FREE_FORM,
    types=TYPES,
    help=HELP,
))
