"""jobs.peers.ggml_isa and jobs.peers.llamacpp without a llama.cpp build: ISA flags from cpuinfo texts, the
commands, the missing-build error, and acceptance from llama-server's trace log."""
from __future__ import annotations

from pathlib import Path

import pytest

from eyas.config import ConfigError
from jobs.peers import ggml_isa, llamacpp

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2\n"
AMX_XEON = ("flags\t\t: sse4_2 avx f16c fma avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi "
            "avx512_vnni avx512_bf16 avx_vnni amx_bf16 amx_tile amx_int8\n")


def options(text: str) -> dict[str, str]:
    return dict(arg[2:].split("=") for arg in ggml_isa.cmake_isa_args(text))


def test_avx2_only_cpu_builds_without_avx512():
    opts = options(AVX2_EPYC)
    assert opts["GGML_NATIVE"] == "OFF"
    assert {k: opts[k] for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")} == \
        dict.fromkeys(("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"), "ON")
    assert opts["GGML_AVX512"] == opts["GGML_AVX512_BF16"] == opts["GGML_AVX_VNNI"] == "OFF"


def test_amx_is_never_enabled_even_where_cpuid_lists_it():
    opts = options(AMX_XEON)
    assert opts["GGML_AVX512"] == opts["GGML_AVX512_BF16"] == opts["GGML_AVX512_VNNI"] == "ON"
    assert opts["GGML_AVX512_VBMI"] == opts["GGML_AVX_VNNI"] == "ON"
    assert opts["GGML_AMX_TILE"] == opts["GGML_AMX_INT8"] == opts["GGML_AMX_BF16"] == "OFF"


def test_avx512_extensions_need_the_avx512_base_flags():
    # avx512f and avx512_bf16 listed, but not avx512bw: GGML_AVX512 (-mavx512bw) and its extensions stay off
    opts = options("flags : avx avx2 fma f16c avx512f avx512cd avx512vl avx512dq avx512_bf16\n")
    assert opts["GGML_AVX512"] == opts["GGML_AVX512_BF16"] == "OFF"
    assert opts["GGML_AVX2"] == "ON"


def test_no_flags_line_keeps_ggml_defaults_with_native_and_amx_off():
    assert ggml_isa.cmake_isa_args("processor : 0\nmodel name : some ARM\n") == [
        "-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def test_the_script_prints_one_line_of_cmake_arguments(tmp_path, capsys):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(AVX2_EPYC)
    assert ggml_isa.main(["ggml_isa.py", str(cpuinfo)]) == 0
    assert capsys.readouterr().out.split() == ggml_isa.cmake_isa_args(AVX2_EPYC)


@pytest.fixture
def fake_build(tmp_path, monkeypatch) -> Path:
    """A directory laid out like `make tools-llamacpp`'s (empty files: nothing here runs them)."""
    for relative in ("bin/llama-server", "bin/llama-bench", "src/convert_hf_to_gguf.py"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).touch()
    monkeypatch.setenv(llamacpp.LLAMACPP_DIR_ENV, str(tmp_path))
    return tmp_path


def test_a_missing_build_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv(llamacpp.LLAMACPP_DIR_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="make tools-llamacpp"):
        llamacpp.llama_server_bin()
    with pytest.raises(ConfigError, match="make tools-llamacpp"):
        llamacpp.convert_command("model", "out.gguf", "f32")


def test_server_command_serves_one_slot_on_localhost_with_the_threads(fake_build):
    command = llamacpp.server_command("t.gguf", 2, 8123)
    assert command[0] == str(fake_build / "bin/llama-server")
    text = " ".join(command)
    assert "-m t.gguf -t 2 -tb 2 -np 1" in text and "--host 127.0.0.1 --port 8123" in text
    assert "-md" not in command
    several = " ".join(llamacpp.server_command("t.gguf", 1, 8123, slots=8, ctx_size=1024))
    assert "-np 8 -c 8192" in several  # the context is shared out among the slots


def test_server_command_drafts_with_an_eagle3_gguf(fake_build):
    command = llamacpp.server_command("t.gguf", 1, 8123, "d.gguf", llamacpp.eagle3_spec_args(3))
    text = " ".join(command)
    assert "-md d.gguf -td 1 -tbd 1" in text
    assert text.endswith("--spec-type draft-eagle3 --spec-draft-n-max 3 --spec-draft-p-min 0")


def test_server_command_drafts_with_a_dflash_gguf(fake_build):
    text = " ".join(llamacpp.server_command("t.gguf", 1, 8123, "d.gguf", llamacpp.dflash_spec_args(4)))
    assert text.endswith("-md d.gguf -td 1 -tbd 1 --spec-type draft-dflash --spec-draft-n-max 4 --spec-draft-p-min 0")
    with pytest.raises(ConfigError, match="num_draft 0"):
        llamacpp.dflash_spec_args(0)


def test_a_draft_speculation_without_a_draft_model_is_refused(fake_build):
    with pytest.raises(ConfigError, match="needs draft_gguf"):
        llamacpp.server_command("t.gguf", 1, 8123, None, llamacpp.eagle3_spec_args(3))
    llamacpp.server_command("t.gguf", 1, 8123, None, llamacpp.ngram_spec_args())  # ngram needs none
    with pytest.raises(ConfigError, match="threads 0"):
        llamacpp.server_command("t.gguf", 0, 8123)


def test_each_draftless_type_gets_its_own_flags():
    assert llamacpp.ngram_spec_args(3, 8) == ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                              "--spec-ngram-simple-size-m", "8")
    assert llamacpp.ngram_spec_args(2, 6, "ngram-map-k") == ("--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n",
                                                             "2", "--spec-ngram-map-k-size-m", "6")
    assert llamacpp.ngram_spec_args(2, 6, "ngram-map-k4v")[2:4] == ("--spec-ngram-map-k4v-size-n", "2")
    # ngram-mod: a hash of n tokens, drafts of 1..m (its n-min default of 48 would draft nothing shorter)
    assert llamacpp.ngram_spec_args(4, 8, "ngram-mod") == ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "4",
                                                           "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "8")
    assert llamacpp.ngram_spec_args(3, 8, "ngram-cache") == ("--spec-type", "ngram-cache", "--spec-draft-n-max", "8")
    with pytest.raises(ConfigError, match="draftless types"):
        llamacpp.ngram_spec_args(3, 8, "draft-eagle3")
    with pytest.raises(ConfigError, match="must be >= 1"):
        llamacpp.ngram_spec_args(0, 8)


def test_only_a_draft_type_needs_a_draft_model(fake_build):
    # ngram-cache's sizes flag is --spec-draft-n-max: no draft model for all its name
    command = llamacpp.server_command("t.gguf", 2, 8123, None, llamacpp.ngram_spec_args(3, 8, "ngram-cache"))
    assert " ".join(command).endswith("--spec-type ngram-cache --spec-draft-n-max 8") and "-md" not in command
    with pytest.raises(ConfigError, match="needs draft_gguf"):
        llamacpp.server_command("t.gguf", 1, 8123, None, ("--spec-type", "ngram-simple,draft-eagle3"))
    assert llamacpp.spec_type(("--spec-draft-n-max", "3")) is None
    assert llamacpp.spec_type(llamacpp.eagle3_spec_args(2)) == "draft-eagle3"


def test_convert_command_for_a_target_and_for_a_drafter(fake_build):
    plain = llamacpp.convert_command("hf", "o.gguf", "q8_0", python="py")
    assert plain == ["py", str(fake_build / "src/convert_hf_to_gguf.py"), "hf", "--outfile", "o.gguf",
                     "--outtype", "q8_0"]
    drafter = llamacpp.convert_command("export", "d.gguf", "f32", target_model_dir="target", python="py")
    assert drafter[-2:] == ["--target-model-dir", "target"]
    with pytest.raises(ConfigError, match="outtype 'q4_0'"):
        llamacpp.convert_command("hf", "o.gguf", "q4_0")


def test_the_converter_reads_the_bundled_gguf_package_first(fake_build, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert llamacpp.converter_env()["PYTHONPATH"].split(":") == [str(fake_build / "src/gguf-py"),
                                                                    str(fake_build / "pylib"), "/elsewhere"]


def test_convert_refuses_a_directory_without_config(fake_build, tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        llamacpp.convert_to_gguf(tmp_path, tmp_path / "o.gguf")


def test_the_request_is_greedy_by_token_ids_without_prompt_cache():
    body = llamacpp.completion_request([1, 2, 3], 16)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16
    assert body["temperature"] == 0.0 and body["cache_prompt"] is False and body["return_tokens"] is True


TRACE_LOG = """\
slot update_slots: id  0 | task 0 | accepted  2/ 3 draft tokens
slot update_slots: id  0 | task 0 | accepted  0/ 3 draft tokens
slot update_slots: id  0 | task 0 | accepted  3/ 3 draft tokens
srv  log_server_r: request: POST /completion 127.0.0.1 200
slot update_slots: id  0 | task 0 | accepted  1/ 2 draft tokens
"""


def test_draft_steps_come_from_the_trace_lines():
    assert llamacpp.draft_steps(TRACE_LOG) == [(2, 3), (0, 3), (3, 3), (1, 2)]


def test_accepted_per_position_counts_steps_unconditionally():
    assert llamacpp.accepted_per_position(llamacpp.draft_steps(TRACE_LOG)) == [3, 2, 1]
    assert llamacpp.accepted_per_position([]) == []


def test_llama_server_runs_without_eyas_openmp_policy():
    environ = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0",
               "HOME": "/h"}
    assert llamacpp.server_env(environ=environ) == {"HOME": "/h"}
    assert llamacpp.server_env(trace=True, environ=environ) == {"HOME": "/h", "LLAMA_TRACE": "1"}
