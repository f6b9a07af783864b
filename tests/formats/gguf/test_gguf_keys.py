"""``lowbit.formats.gguf.keys.read_keys`` reads a GGUF header's key/values as gguf-py's
``GGUFReader`` gives them (value, type, element type), for every value type, and ``gguf_keys``
leaves what it does not read (another byte order, arrays of arrays) to ``GGUFReader``; a file cut
short or not GGUF is one FormatError line."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from lowbit.errors import FormatError  # noqa: E402
from lowbit.formats.gguf.convert import gguf_keys  # noqa: E402
from lowbit.formats.gguf.keys import Unsupported, read_keys  # noqa: E402

T = gguf.GGUFValueType


def _write(path, endianess=gguf.GGUFEndian.LITTLE, nested=False):
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    w.add_uint8("k.u8", 255)
    w.add_int8("k.i8", -128)
    w.add_uint16("k.u16", 65535)
    w.add_int16("k.i16", -32768)
    w.add_uint32("k.u32", 2**32 - 1)
    w.add_int32("k.i32", -(2**31))
    w.add_float32("k.f32", float(np.float32(0.1)))
    w.add_uint64("k.u64", 2**64 - 1)
    w.add_int64("k.i64", -(2**63))
    w.add_float64("k.f64", 1e-300)
    w.add_bool("k.true", True)
    w.add_bool("k.false", False)
    w.add_string("k.s", "héllo ▁ 世界 \n")
    w.add_array("k.tokens", ["<s>", "", "▁the", "\u0120é", "🦙"] * 50)
    w.add_key_value("k.u8s", [0, 1, 255], T.ARRAY, T.UINT8)
    w.add_key_value("k.i32s", [-1, 0, 2**31 - 1], T.ARRAY, T.INT32)
    w.add_key_value("k.f32s", [0.5, -1e-30, 3.4e38], T.ARRAY, T.FLOAT32)
    w.add_key_value("k.f64s", [0.1, -2.5], T.ARRAY, T.FLOAT64)
    w.add_key_value("k.bools", [True, False, True], T.ARRAY, T.BOOL)
    w.add_key_value("k.i64s", [-(2**63), 2**63 - 1], T.ARRAY, T.INT64)
    if nested:
        w.add_array("k.nested", [[1, 2], [3]])
    w.add_tensor("t", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _reference(path):
    r = gguf.GGUFReader(path)
    return {k: (f.contents(), f.types[0].value, f.types[-1].value if f.types[0] == T.ARRAY else None)
            for k, f in r.fields.items() if not k.startswith("GGUF.")}


def test_every_value_type_reads_as_gguf_py_reads_it(tmp_path):
    _write(tmp_path / "a.gguf")
    got, want = read_keys(tmp_path / "a.gguf"), _reference(tmp_path / "a.gguf")
    assert list(got) == list(want) and len(got) == 21
    for k in want:
        assert got[k] == want[k], k
        values = got[k][0] if isinstance(got[k][0], list) else [got[k][0]]
        ref = want[k][0] if isinstance(want[k][0], list) else [want[k][0]]
        assert [type(v) for v in values] == [type(v) for v in ref], k  # bool stays bool, float float
    assert got["k.tokens"][0][4] == "🦙" and got["k.u64"][0] == 2**64 - 1


def test_gguf_keys_gives_the_values_the_writer_takes_back(tmp_path):
    _write(tmp_path / "a.gguf")
    kv = gguf_keys(tmp_path / "a.gguf", "k.")
    assert kv["k.tokens"].type is T.ARRAY and kv["k.tokens"].sub_type is T.STRING
    assert kv["k.f32"].type is T.FLOAT32 and kv["k.f32"].sub_type is None
    w = gguf.GGUFWriter(tmp_path / "b.gguf", "llama")
    for k, v in kv.items():
        w.add_key_value(k, v.value, v.type, v.sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    again = read_keys(tmp_path / "b.gguf")
    assert {k: again[k] for k in kv} == {k: read_keys(tmp_path / "a.gguf")[k] for k in kv}


@pytest.mark.parametrize("big,nested", [(True, False), (False, True)])
def test_what_the_header_reader_leaves_goes_to_gguf_py(tmp_path, big, nested):
    path = tmp_path / "a.gguf"
    _write(path, gguf.GGUFEndian.BIG if big else gguf.GGUFEndian.LITTLE, nested)
    with pytest.raises(Unsupported):
        read_keys(path)
    kv = gguf_keys(path, "k.")
    assert kv["k.tokens"].value == ["<s>", "", "▁the", "\u0120é", "🦙"] * 50 and kv["k.i8"].value == -128


def test_a_file_cut_short_or_not_gguf_is_one_format_error(tmp_path):
    _write(tmp_path / "a.gguf")
    data = (tmp_path / "a.gguf").read_bytes()
    for name, body in [("cut.gguf", data[:200]), ("not.gguf", b"PK\x03\x04" + data[4:])]:
        (tmp_path / name).write_bytes(body)
        with pytest.raises(FormatError, match=rf"cannot read .*{name}") as e:
            gguf_keys(tmp_path / name)
        assert "\n" not in str(e.value)


def test_empty_strings_and_arrays(tmp_path):
    """gguf-py's writer leaves empty values out; a header written by hand holds them."""
    import struct

    def s(x: bytes) -> bytes:
        return struct.pack("<Q", len(x)) + x

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 3)
    body += s(b"k.empty") + struct.pack("<I", 8) + s(b"")
    body += s(b"k.none") + struct.pack("<IIQ", 9, 4, 0)
    body += s(b"k.strs") + struct.pack("<IIQ", 9, 8, 2) + s(b"") + s("é".encode())
    (tmp_path / "e.gguf").write_bytes(body)
    got = read_keys(tmp_path / "e.gguf")
    assert got == {"k.empty": ("", 8, None), "k.none": ([], 9, 4), "k.strs": (["", "é"], 9, 8)}
    want = _reference(tmp_path / "e.gguf")
    assert want.pop("k.none") == ([], 9, 9)  # gguf-py reports no element type for an empty array
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("big", [False, True])
def test_tensor_types_from_the_header_are_gguf_pys(tmp_path, big):
    """``file_tensor_types`` (``lowbit inspect`` on a GGUF) reads the tensor infos after the keys;
    a big-endian file goes to gguf-py's reader, with the same answer."""
    from lowbit.formats.gguf.keys import read_tensor_types
    from lowbit.formats.gguf.read import file_tensor_types

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG if big else gguf.GGUFEndian.LITTLE)
    w.add_array("k.tokens", ["a", "bb"] * 100)
    w.add_tensor("norm", np.ones(32, dtype=np.float32))
    w.add_tensor("q8", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("k4", np.zeros((3, 144), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.add_tensor("h", np.zeros((4, 8, 2), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert file_tensor_types(path) == want == {"norm": "F32", "q8": "Q8_0", "k4": "Q4_K", "h": "F16"}
    if big:
        with pytest.raises(Unsupported):
            read_tensor_types(path)
    else:
        assert list(read_tensor_types(path)) == ["norm", "q8", "k4", "h"]
        (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:-(path.stat().st_size - 1500)])
        with pytest.raises(FormatError, match="cannot read .*cut.gguf"):
            file_tensor_types(tmp_path / "cut.gguf")
