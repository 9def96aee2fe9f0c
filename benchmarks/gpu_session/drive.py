"""Real-size (Flickr30K) runs for the GPU session: write a folder now, run it later (bench_scale's builders
and its /proc sampler, unchanged)."""
import json, os, pathlib, sys, time
from benchmarks import bench_scale

work = pathlib.Path(os.environ["BENCH_WORK"]); work.mkdir(parents=True, exist_ok=True)
verb, system, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
folder, run_dir, spec = work / f"{system}_{n}", work / f"{system}_{n}_run", work / f"{system}_{n}.cmd.json"
if verb == "write":
    test, dtype, steps = int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
    start = time.perf_counter()
    command = bench_scale.BUILDERS[system](folder, n, test, dtype, run_dir, steps, verbose=2)
    spec.write_text(json.dumps({"command": command, "write_seconds": time.perf_counter() - start}))
    print(f"{system} N={n}: folder written in {time.perf_counter() - start:.1f} s", flush=True)
else:
    while not spec.exists():
        time.sleep(1)
    extra = sys.argv[4:]
    command = json.loads(spec.read_text())["command"] + extra
    label = "".join("_" + e.split("=")[-1] for e in extra if e.startswith("--strategy"))
    figures = bench_scale.run_measured(command, work / f"{system}_{n}{label}.log",
                                       float(os.environ.get("RUN_TIMEOUT", "200")))
    print(f"{system} N={n} {' '.join(extra)}: exit {figures['exit_code']} in {figures['seconds']:.1f} s; peak anonymous RSS "
          f"{figures['peak_anon_mb']:.0f} MB, peak RSS {figures['peak_rss_mb']:.0f} MB (mapped files "
          f"{figures['peak_file_mb']:.0f} MB)", flush=True)
