"""Users' own traces: workload CSVs outside the bundled data (cluster_sim and bench cluster take their paths,
bad rows name the row), and the Philly trace converter (GPU-time -> application, windowing, both input forms)."""
import json
from pathlib import Path

import numpy as np
import pytest

from omnijax.cluster.philly import application_for, read_philly, to_workload, write_workload
from omnijax.cluster.traces import load_workload, workload_files
from omnijax.errors import ConfigError, UserError

HEADER = "name,time,application,num_replicas,batch_size\n"


pytestmark = pytest.mark.usefixtures("synthetic_cluster_data")  # no shared data needed


def _philly_json(path: Path) -> Path:
    """Five jobs as the public cluster_job_log has them (one never ran, one ran twice)."""
    def attempt(start, end, gpus_per_machine):
        return {"start_time": start, "end_time": end,
                "detail": [{"ip": f"m{i}", "gpus": [f"gpu{k}" for k in range(g)]} for i, g in enumerate(gpus_per_machine)]}
    jobs = [
        {"jobid": "application_1", "submitted_time": "2017-10-03 02:00:00", "status": "Pass", "user": "u",
         "attempts": [attempt("2017-10-03 02:00:10", "2017-10-03 02:10:10", [2])]},            # 2 GPUs x 10 min
        {"jobid": "application_2", "submitted_time": "2017-10-03 02:05:00", "status": "Killed", "user": "u",
         "attempts": []},                                                                         # never ran
        {"jobid": "application_3", "submitted_time": "2017-10-03 02:30:00", "status": "Pass", "user": "u",
         "attempts": [attempt("2017-10-03 02:31:00", "2017-10-03 03:00:00", [4]),
                      attempt("2017-10-03 03:10:00", "2017-10-03 04:31:00", [4])]},             # 4 x 2 h (first start to last end)
        {"jobid": "application_4", "submitted_time": "2017-10-03 03:00:00", "status": "Failed", "user": "u",
         "attempts": [attempt("2017-10-03 03:00:00", "2017-10-03 08:00:00", [4, 4])]},          # 8 x 5 h
        {"jobid": "application_5", "submitted_time": "2017-10-03 11:00:00", "status": "Pass", "user": "u",
         "attempts": [attempt("2017-10-03 11:00:00", "2017-10-03 21:00:00", [8, 8])]},          # 16 x 10 h, late
    ]
    path.write_text(json.dumps(jobs))
    return path


def test_user_workload_path_loads_and_bad_rows_name_the_row(tmp_path):
    good = tmp_path / "mine.csv"
    good.write_text(HEADER + "b,120,ncf,1,256\na,60.5,cifar10,2,256\n")
    jobs = load_workload(str(good))
    assert [(j.name, j.time, j.application, j.num_replicas) for j in jobs] == [("a", 60.5, "cifar10", 2),
                                                                                 ("b", 120.0, "ncf", 1)]
    cases = {"name,time,application,num_replicas\nx,1,ncf,1\n": r"row 1: .*lacks column\(s\) batch_size",
             HEADER + "a,1,ncf,1,256\nb,soon,ncf,1,256\n": "row 3: cannot parse",
             HEADER + "a,1,ncf,1,256\nb,2,gpt9,1,256\n": "row 3: unknown application 'gpt9'",
             HEADER + "a,1,ncf,0,256\n": "row 2: bad job",
             HEADER + "a,-5,ncf,1,256\n": "row 2: bad job",
             HEADER + "a,1,ncf,1,256\na,2,ncf,1,256\n": "row 3: job name 'a' already used in row 2",
             HEADER: "no jobs"}
    for i, (text, err) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.csv"
        bad.write_text(text)
        with pytest.raises(UserError, match=err) as exc:
            load_workload(str(bad))
        assert str(bad) in str(exc.value)
    with pytest.raises(UserError, match="does not exist"):
        load_workload(str(tmp_path / "nope.csv"))


def test_workload_files_resolves_sets_folders_and_files(tmp_path):
    assert workload_files("workloads", 2) == ["workloads/workload-1", "workloads/workload-2"]
    assert workload_files("workloads", 0) == [f"workloads/workload-{i}" for i in (1, 2, 3)]
    for name in ("w-10.csv", "w-9.csv", "w-1.csv"):
        (tmp_path / name).write_text(HEADER + "a,1,ncf,1,256\n")
    assert [Path(p).name for p in workload_files(str(tmp_path), 0)] == ["w-1.csv", "w-9.csv", "w-10.csv"]
    assert [Path(p).name for p in workload_files(str(tmp_path), 2)] == ["w-1.csv", "w-9.csv"]
    assert workload_files(str(tmp_path / "w-9.csv")) == [str(tmp_path / "w-9.csv")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no .csv"):
        workload_files(str(tmp_path / "empty"))


def test_philly_mapping_follows_gpu_hours():
    rng = np.random.default_rng(0)
    picks = {h: {application_for(h, rng) for _ in range(200)} for h in (0.3, 5.0, 40.0, 160.0)}
    assert picks == {0.3: {"cifar10", "ncf"}, 5.0: {"deepspeech2", "bert"}, 40.0: {"yolov3"}, 160.0: {"imagenet"}}


def test_philly_json_converts_to_a_workload(tmp_path):
    jobs, skipped = read_philly(_philly_json(tmp_path / "cluster_job_log"))
    assert skipped == 1
    assert [(j.job_id, j.num_gpus, j.duration_s) for j in jobs] == [
        ("application_1", 2, 600.0), ("application_3", 4, 7200.0), ("application_4", 8, 18000.0),
        ("application_5", 16, 36000.0)]
    specs = to_workload(jobs, hours=8.0)          # from the first submission: application_5 is outside
    assert [s.time for s in specs] == [0.0, 1800.0, 3600.0]
    assert specs[0].application in ("cifar10", "ncf") and specs[1].application in ("deepspeech2", "bert")
    assert specs[2].application == "yolov3" and specs[2].name == "yolov3-2"
    # the GPU count survives where the profiled batch allows it; the batch is a profiled one
    from omnijax.cluster.traces import load_profile
    for s, j in zip(specs, jobs):
        prof = load_profile(s.application)
        assert s.batch_size in prof.iterations and 1 <= s.num_replicas <= j.num_gpus
        assert s.batch_size / s.num_replicas >= prof.min_local_bsz
    assert specs[2].num_replicas == 8                       # yolov3 at 8 GPUs: batch 64 = 8 x the smallest (8)
    everything = to_workload(jobs, hours=24.0, max_gpus=8)
    assert everything[-1].application == "imagenet" and everything[-1].num_replicas <= 8
    assert len(to_workload(jobs, hours=24.0, count=2, seed=1)) == 2
    with pytest.raises(UserError, match="no Philly job"):
        to_workload(jobs, start_s=0.0, hours=1.0)


def test_philly_csv_and_bad_records_name_the_row(tmp_path):
    good = tmp_path / "philly.csv"
    good.write_text("jobid,submitted_time,num_gpus,duration\nj1,2017-10-03 02:00:00,1,600\nj2,2017-10-03 02:01:00,0,60\n"
                    "j3,2017-10-03 02:02:00,2,3600\n")
    jobs, skipped = read_philly(good)
    assert skipped == 1 and [j.job_id for j in jobs] == ["j1", "j3"] and jobs[1].submit_s - jobs[0].submit_s == 120
    for i, (text, err) in enumerate({
            "jobid,submitted_time,duration\nj1,0,5\n": "row 1: no num_gpus column",
            "jobid,submit_time,num_gpus,duration\nj1,0,1,5\nj2,yesterday,1,5\n": "row 3: cannot parse",
            "jobid,submit_time,num_gpus,duration\nj1,0,1,-5\n": "row 2: bad job",
            '[{"jobid": "a", "attempts": []}]': r"job 0 \(a\): cannot parse"}.items()):
        bad = tmp_path / f"bad{i}.csv"
        bad.write_text(text)
        with pytest.raises(UserError, match=err):
            read_philly(bad)


def test_converted_trace_runs_in_cluster_sim_and_the_bench(tmp_path, monkeypatch, capsys):
    """End to end: convert_philly writes a workload CSV; cluster_sim and bench cluster take its path."""
    from recipes import cluster_sim, convert_philly
    from recipes.bench import cluster as bench_cluster
    monkeypatch.setenv("OMNIJAX_RUNS", str(tmp_path / "runs"))
    out = tmp_path / "mine" / "philly-1.csv"
    assert convert_philly.main([f"input={_philly_json(tmp_path / 'log.json')}", f"output={out}", "hours=24"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["written"] == 4 and summary["skipped_never_ran"] == 1 and out.exists()
    assert cluster_sim.main([f"workload={out}", "scheduler=drf", "sim.num_nodes=4", "plot=false", "run_name=philly"]) == 0
    report = json.loads((tmp_path / "runs" / "philly" / "report.json").read_text())
    assert len(report["jobs"]) == 4
    write_workload(load_workload(str(out))[:2], out.parent / "philly-2.csv")
    rows = list(bench_cluster.run([f"workloads=[{out.parent}]", "files=0", "schedulers=[fifo,drf]", "sim.num_nodes=4",
                                   "lp_interval_s=600"]))
    by = {r["variant"]: r for r in rows}
    assert by["drf"]["files"] == 2 and by["drf"]["workload"] == str(out.parent)
    assert by["bound_lp"]["avg_jct_s"] <= min(by["fifo"]["avg_jct_s"], by["drf"]["avg_jct_s"])
    with pytest.raises(ConfigError, match="input"):
        convert_philly.main([f"output={out}"])


def test_hindsight_bench_reports_the_best_cell_and_policy_relative_to_fitted():
    from recipes.bench import cluster_hindsight
    rows = list(cluster_hindsight.run(["workloads=[workloads/workload-1]", "limit=12", "betas=[1.0,2.0]",
                                       "resize_penalties_s=[300.0]", "hysteresis=[0.0]", "es_iterations=1",
                                       "es_pairs=1", "sim.num_nodes=2"]))
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"fitted", "grid", "grid_oracle", "es_on_file"} and by["fitted"]["jobs"] == 12
    # the grid holds fitted's defaults (beta 2, penalty 300, no hysteresis): its best cell is no worse
    assert by["grid"]["jct_ratio"] <= 1.0 and by["grid"]["cells"] == 2
    assert by["grid"]["avg_jct_s"] == pytest.approx(by["grid"]["jct_ratio"] * by["fitted"]["avg_jct_s"], rel=1e-3)
    assert by["es_on_file"]["policies"] == 2 and by["es_on_file"]["jct_ratio"] > 0
    with pytest.raises(ConfigError):
        list(cluster_hindsight.run(["betas=[]"]))
