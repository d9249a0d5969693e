"""data_pipeline.pipeline's runner set-up: a DirectRunner build goes straight to the FnApiRunner
(never Beam's Prism attempt) with the options for its workers, other runners are Beam's, and
every build runs without Beam's type inference."""
from __future__ import annotations

import pytest
from apache_beam.options.pipeline_options import PipelineOptions

from data_pipeline.pipeline import NO_TYPE_CHECK, local_runner, with_build_defaults


@pytest.mark.parametrize("runner", ["DirectRunner", "SwitchingDirectRunner",
                                    "apache_beam.runners.direct.direct_runner.DirectRunner", None])
def test_a_direct_runner_build_gets_the_fn_api_runner_with_its_options(runner):
    from apache_beam.runners.portability.fn_api_runner import fn_runner

    args = ([f"--runner={runner}"] if runner else []) + ["--direct_num_workers=2", "--job_name=probe"]
    got = local_runner(PipelineOptions(args))
    assert isinstance(got, fn_runner.FnApiRunner)
    options = got._provision_info.provision_info.pipeline_options  # what its workers are given
    assert str(options["beam:option:direct_num_workers:v1"]) == "2" and options["beam:option:job_name:v1"] == "probe"


@pytest.mark.parametrize("runner", ["PortableRunner", "DataflowRunner", "FlinkRunner", "FnApiRunner"])
def test_other_runners_are_left_to_beam(runner):
    assert local_runner(PipelineOptions([f"--runner={runner}"])) is None


def test_builds_run_without_beams_type_inference_once():
    assert with_build_defaults(["--runner=DirectRunner"]) == ["--runner=DirectRunner", NO_TYPE_CHECK]
    assert with_build_defaults([NO_TYPE_CHECK]) == [NO_TYPE_CHECK]
    assert not PipelineOptions(with_build_defaults([])).get_all_options()["pipeline_type_check"]
