"""The one reader of /proc/cpuinfo: the kernels' build key and the benchmarks' records depend on it."""

from sparseattn.machine import ISA_FLAGS, cpu_model, parse_cpuinfo

X86 = """processor\t: 0
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16
processor\t: 1
model name\t: Example CPU 9000
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16

"""


def test_cpuinfo_fields_are_stripped_and_the_last_core_wins():
    fields = parse_cpuinfo(X86 + "processor\t: 2\nbogus line without a colon\n")
    assert fields["model name"] == "Example CPU 9000"
    assert fields["processor"] == "2"
    assert fields["flags"].split() == ["fpu", "sse2", "avx2", "avx512f", "avx512_bf16"]
    assert "bogus line without a colon" not in fields


def test_the_cpu_record_names_only_known_instruction_sets_in_their_order():
    info = cpu_model()
    assert set(info) == {"cpu", "isa"}
    assert info["isa"] == [f for f in ISA_FLAGS if f in info["isa"]]
