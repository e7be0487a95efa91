"""utils.course.bench.ncu: parsing ncu's details CSV, the command lines it runs, its arguments and its table (no ncu)."""
import shutil

import pytest

from utils.course.bench import ncu

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(section, metric, unit, value, kernel_id="0"):
    return (f'"{kernel_id}","711","python3.12","127.0.0.1","hopper_attention_ws_kernel","1","7","(384, 1, 1)",'
            f'"(64, 64, 1)","0","9.0","{section}","{metric}","{unit}","{value}"')


CSV = "\n".join([
    "checked 2 launches",  # the profiled program's own output comes first
    "==PROF== Profiling \"hopper_attention_ws_kernel\": 0%....50%....100% - 38 passes",
    HEADER,
    _row("GPU Speed Of Light Throughput", "Duration", "ms", "7.53"),
    _row("GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%", "44.67"),
    _row("GPU Speed Of Light Throughput", "Elapsed Cycles", "cycle", "13,675,773"),
    _row("Launch Statistics", "Registers Per Thread", "register/thread", "168"),
    _row("Occupancy", "Achieved Occupancy", "%", "18.71"),
    _row("Launch Statistics", "", "", ""),  # a rule's row: no metric
    _row("Launch Statistics", "Function Cache Configuration", "", "CachePreferNone"),
])


def test_parse_details_reads_sections_metrics_and_numbers():
    out = ncu.parse_details(CSV)
    sol = out["GPU Speed Of Light Throughput"]
    assert sol["Duration"] == [7.53, "ms"] and sol["Elapsed Cycles"] == [13675773.0, "cycle"]
    assert out["Launch Statistics"]["Function Cache Configuration"] == ["CachePreferNone", ""]
    assert "" not in out["Launch Statistics"] and out["Occupancy"]["Achieved Occupancy"] == [18.71, "%"]


@pytest.mark.parametrize("text,message", [
    ("no csv here", "no ncu CSV"),
    ('"ID","Kernel Name"\n"0","k"', "no column"),
    ("\n".join([HEADER, _row("Occupancy", "Achieved Occupancy", "%", "1"),
                _row("Occupancy", "Achieved Occupancy", "%", "2", kernel_id="1")]), "expected one profiled kernel"),
])
def test_parse_details_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        ncu.parse_details(text)
    with pytest.raises(TypeError):
        ncu.parse_details(b"bytes")


def test_the_ncu_command_profiles_the_second_launch_of_the_worklog_kernel():
    args = ncu.parse_args(["--worklog", "hopper", "--steps", "overlap", "--head-dim", "64", "--causal"])
    cmd = ncu.ncu_command("/opt/ncu", "hopper", "overlap", args)
    assert cmd[:3] == ["/opt/ncu", "--clock-control", "none"] and "regex:hopper_attention" in cmd
    assert cmd[cmd.index("--launch-skip") + 1] == "1" and cmd[cmd.index("--launch-count") + 1] == "1"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"] == list(ncu.SECTIONS)
    child = cmd[cmd.index("utils.course.bench.ncu") - 1:]
    assert child[:4] == ["-m", "utils.course.bench.ncu", "--child", "--worklog"] and "--causal" in child
    assert child[child.index("--head-dim") + 1] == "64" and child[child.index("--steps") + 1] == "overlap"
    with pytest.raises(ValueError, match="step must be one of"):
        ncu.ncu_command("/opt/ncu", "mma", "overlap", args)


def test_parse_args_defaults_and_checks():
    args = ncu.parse_args([])
    assert args.worklog == "hopper" and args.name == "hopper_ncu" and len(args.steps) > 5
    assert ncu.parse_args(["--worklog", "mma"]).name == "mma_ncu"
    for argv in (["--steps", "exp2"], ["--seqlen", "0"], ["--head-dim", "96"], ["--worklog", "volta"]):
        with pytest.raises(SystemExit):
            ncu.parse_args(argv)


def test_format_table_shows_the_headline_and_marks_what_is_missing():
    text = ncu.format_table({"h6_overlap": ncu.parse_details(CSV), "h4_softmax": {}})
    head, overlap, softmax = text.splitlines()
    assert "SM %" in head and "regs" in head and "time µs" in head and overlap.startswith("h6_overlap")
    cells = overlap.split()[1:]
    assert cells[0] == "7530" and "44.67" in cells and "168" in cells  # 7.53 ms in µs; units live in the header
    assert len(cells) == len(ncu.HEADLINE)
    assert softmax.split()[1:] == ["—"] * len(ncu.HEADLINE)


@pytest.mark.skipif(shutil.which("ncu") is not None, reason="ncu is installed here")
def test_main_without_ncu_says_what_it_needs():
    with pytest.raises(SystemExit, match="needs Nsight Compute"):
        ncu.main(["--steps", "overlap"])


def test_the_triton_backward_worklog_profiles_each_pass_on_its_own():
    args = ncu.parse_args(["--worklog", "triton_bwd", "--seqlen", "4096", "--causal"])
    assert args.steps == ["pointer", "tma", "tma_stats"] and args.name == "triton_bwd_ncu"
    for kernel, regex in (("dkdv", "regex:_bwd_dkdv"), ("dq", "regex:_bwd_dq")):
        cmd = ncu.ncu_command("/opt/ncu", "triton_bwd", "tma_stats", args, kernel)
        assert cmd[cmd.index("-k") + 1] == regex and cmd[cmd.index("--launch-skip") + 1] == "1"
        child = cmd[cmd.index("utils.course.bench.ncu") - 1:]
        assert child[child.index("--worklog") + 1] == "triton_bwd" and child[child.index("--steps") + 1] == "tma_stats"
        assert child[child.index("--seqlen") + 1] == "4096" and "--causal" in child
    assert ncu.profile_label("tma", "triton_bwd", "dq") == "b2_tma dq"
    assert ncu.profile_label("overlap", "hopper") == ncu.step_label("overlap", "hopper")
    with pytest.raises(ValueError, match="kernel must be one of"):
        ncu.ncu_command("/opt/ncu", "triton_bwd", "tma_stats", args)
    with pytest.raises(ValueError, match="step must be one of"):
        ncu.profile_label("overlap", "triton_bwd", "dq")
    with pytest.raises(SystemExit):
        ncu.parse_args(["--worklog", "triton_bwd", "--steps", "overlap"])


def test_the_hopper_backward_worklog_profiles_each_step_and_flash_attention_4():
    args = ncu.parse_args(["--worklog", "hopper_bwd", "--seqlen", "4096"])
    assert args.steps == list(ncu.HOPPER_BWD) and args.steps[-1] == "flash-attn-4" and not args.source
    ours = ncu.ncu_command("/opt/ncu", "hopper_bwd", "late_dq_first", args)
    peer = ncu.ncu_command("/opt/ncu", "hopper_bwd", "flash-attn-4", args)
    assert ours[ours.index("-k") + 1] == "regex:hopper_backward_kernel"
    assert peer[peer.index("-k") + 1] == "regex:BackwardSm90"  # its main kernel, not the passes around it
    for cmd, step in ((ours, "late_dq_first"), (peer, "flash-attn-4")):
        child = cmd[cmd.index("utils.course.bench.ncu") - 1:]
        assert child[child.index("--steps") + 1] == step and child[child.index("--seqlen") + 1] == "4096"
    n = ncu.BWD_STEPS.index("late_dq_first") + 1
    assert ncu.profile_label("late_dq_first", "hopper_bwd") == f"hb{n}_late_dq_first"
    assert ncu.profile_label("flash-attn-4", "hopper_bwd") == "flash-attn-4"
    with pytest.raises(ValueError, match="step must be one of"):
        ncu.profile_label("overlap", "hopper_bwd")
    with pytest.raises(SystemExit):
        ncu.parse_args(["--worklog", "hopper_bwd", "--steps", "overlap"])


def test_with_source_the_profile_is_saved_and_read_back_twice():
    args = ncu.parse_args(["--worklog", "hopper_bwd", "--steps", "late_dq_first", "--source"])
    assert args.source
    cmd = ncu.ncu_command("/opt/ncu", "hopper_bwd", "late_dq_first", args, report="/tmp/x/profile")
    assert "--csv" not in cmd[:cmd.index("-k")] and cmd[cmd.index("-o") + 1] == "/tmp/x/profile"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"] == [*ncu.SECTIONS, "SourceCounters"]
    details, sass = ncu.import_commands("/opt/ncu", "/tmp/x/profile")
    assert details == ["/opt/ncu", "--import", "/tmp/x/profile.ncu-rep", "--csv", "--page", "details"]
    assert sass[:4] == ["/opt/ncu", "--import", "/tmp/x/profile.ncu-rep", "--csv"]
    assert sass[sass.index("--page") + 1] == "source" and sass[sass.index("--print-source") + 1] == "sass"


SASS_HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
               '"Instructions Executed","stall_barrier","stall_short_sb","stall_mio","stall_mio (Not Issued)"')


def _sass(address, source, samples, executed, barrier, short_sb, mio):
    return f'"{address}","{source}","{samples}","0","{executed}","{barrier}","{short_sb}","{mio}","0"'


SASS = "\n".join([
    '"Kernel Name","hopper_backward_kernel"',
    SASS_HEADER,
    _sass("0x10", "      STS [R5+0x400], R152", "30", "1,000", "0", "0", "30"),
    _sass("0x20", "@!P0  BRA 0x70", "10", "500", "10", "0", "0"),
    _sass("0x30", "      FFMA R1, R1, UR10, -R12", "60", "3,000", "0", "50", "10"),
    _sass("0x40", "      STS.128 [R0], R152", "0", "500", "0", "0", "0"),
    '"Kernel Name","hopper_backward_kernel"',  # a second listing of the same kernel is not read
    SASS_HEADER,
    _sass("0x10", "      STS [R5+0x400], R152", "999", "999", "999", "0", "0"),
])


def test_parse_source_reads_the_mix_the_stalls_and_the_top_instructions():
    out = ncu.parse_source(SASS, top=2)
    assert out["instructions"] == 5000.0
    assert out["opcodes"] == {"FFMA": 0.6, "STS": 0.3, "BRA": 0.1}  # modifiers and predicates dropped
    assert out["stalls"] == {"short_sb": 0.5, "mio": 0.4, "barrier": 0.1}  # "(Not Issued)" columns left out
    assert out["stalled_at"] == {"FFMA": 0.6, "STS": 0.3, "BRA": 0.1}
    assert [line[:2] for line in out["top"]] == [[0.6, "FFMA R1, R1, UR10, -R12"], [0.3, "STS [R5+0x400], R152"]]
    assert out["top"][0][2] == pytest.approx({"short_sb": 50 / 60, "mio": 10 / 60})


@pytest.mark.parametrize("text,message", [
    ("no listing", "no SASS listing"),
    ('"Address","Source","Instructions Executed"\n"0x1","NOP","1"', "no column"),
    (SASS_HEADER, "no executed instruction"),
])
def test_parse_source_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        ncu.parse_source(text)
    with pytest.raises(TypeError):
        ncu.parse_source(b"bytes")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="top must be"):
            ncu.parse_source(SASS, top=bad)


def test_format_stalls_shows_the_instructions_and_the_samples_at_each_opcode():
    source = {"hb15_late_dq_first": ncu.parse_source(SASS), "hb16_frag_dq": dict(instructions=2.5e9,
                                                                                stalled_at={"STS": 0.02})}
    lines = ncu.format_stalls(source, opcodes=("STS", "FFMA")).splitlines()
    assert lines[0].split() == ["step", "instr", "G", "STS", "%", "FFMA", "%"]
    assert lines[1].split() == ["hb15_late_dq_first", "0.000", "30.0", "60.0"]
    assert lines[2].split() == ["hb16_frag_dq", "2.500", "2.0", "0.0"]  # an opcode never stalled at reads 0
    with pytest.raises(TypeError, match="source must be"):
        ncu.format_stalls([])
    for bad in ("STS", (), ("STS", "")):
        with pytest.raises(ValueError, match="opcodes must be"):
            ncu.format_stalls(source, opcodes=bad)


def test_format_shares_shows_one_entry_of_each_reading_in_percent():
    source = {"ours": dict(opcodes={"MUFU": 0.125, "LDS": 0.05}, stalls={"wait": 0.2}),
              "flash-attn-4": dict(opcodes={"SHFL": 0.096}, stalls={"wait": 0.1, "mio": 0.09})}
    lines = ncu.format_shares(source, "opcodes", ("MUFU", "SHFL", "LDS")).splitlines()
    assert lines[0].split() == ["opcodes,", "%", "MUFU", "SHFL", "LDS"]
    assert lines[1].split() == ["ours", "12.5", "0.0", "5.0"]  # a name the reading lacks reads 0
    assert lines[2].split() == ["flash-attn-4", "0.0", "9.6", "0.0"]
    assert ncu.format_shares(source, "stalls", ("mio",)).splitlines()[1:] == [f"{'ours':<20s}{'0.0':>10s}",
                                                                             f"{'flash-attn-4':<20s}{'9.0':>10s}"]
    with pytest.raises(ValueError, match="entry must be one of"):
        ncu.format_shares(source, "reasons", ("wait",))
    with pytest.raises(TypeError, match="source must be"):
        ncu.format_shares([], "stalls", ("wait",))
    for bad in ("wait", (), ("wait", None)):
        with pytest.raises(ValueError, match="names must be"):
            ncu.format_shares(source, "stalls", bad)
