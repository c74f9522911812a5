"""The main job (a file without a ``study:`` key): does an embedding-based partition hurt federated learning
more than a label-based one at equal Dirichlet α? Steps 1–4 for every task × grouping × α × algorithm × seed,
then the gap report (config: the file's keys; runner: the steps; report, iid, meter, plots: the report).

The package also registers the ``mechanism`` kind (mechanism.py): the main job once per knob level, which runs this
package's runner, so it lives here rather than importing one kind from another."""

from pipeline.studies.main_job import config, disk, mechanism, runner  # noqa: F401  (mechanism registers itself)
from pipeline.studies.registry import MAIN_JOB, StudyKind, register

register(StudyKind(
    name=MAIN_JOB,
    summary="label- vs embedding-based partitions: the federated loss gap per task × algorithm × α (the paper's question)",
    schema=config.SCHEMA,
    load=config.load,
    run=runner.run,
    report_unit="task × algorithm × α rows",
    types=config.TYPES,
    help=config.HELP,
    free_form=config.FREE_FORM,  # an override may name a key inside federated.privacy, federated.algorithms, ...
    disk_plan=disk.disk_plan,
))
