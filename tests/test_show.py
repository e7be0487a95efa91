"""utils.course.show: C++ and Python definitions found by name, never by text anchors."""
import pytest

from utils.course.show import CUDA_DIR, cpp_definition, python_definition, show_cpp, show_python

SOURCE = """\
#include <x.h>
// not this one: a declaration
__device__ float scale(float v);

// Doubles v.
// Two lines of comment belong to it.
__device__ __forceinline__ float scale(float v) {
  const char* s = "}{";  // braces in strings and comments do not count }
  /* nor here { */
  return v * 2.f;
}

template <int D>
struct Tile {
  static constexpr int kRows = D;
};

__global__ void kernel(float* x) {
  const auto finish = [&](int i) {
    x[i] = scale(x[i]);
  };
  finish(threadIdx.x);
}
"""


def test_a_function_comes_with_its_comment_and_whole_body():
    text = cpp_definition(SOURCE, "scale")
    assert text.startswith("// Doubles v.\n// Two lines") and text.endswith("return v * 2.f;\n}")
    assert "declaration" not in text


def test_structs_templates_and_named_lambdas():
    assert cpp_definition(SOURCE, "Tile") == "template <int D>\nstruct Tile {\n  static constexpr int kRows = D;\n};"
    assert cpp_definition(SOURCE, "finish") == ("  const auto finish = [&](int i) {\n    x[i] = scale(x[i]);\n"
                                                "  };")
    assert cpp_definition(SOURCE, "kernel").endswith("finish(threadIdx.x);\n}")


def test_a_name_only_called_or_declared_is_not_a_definition():
    with pytest.raises(ValueError, match="no definition of 'nothing'"):
        cpp_definition(SOURCE + "void f() { nothing(1); }\nvoid nothing(int);\n", "nothing")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="name must be a C\\+\\+ identifier"):
        cpp_definition(SOURCE, "scale(")
    with pytest.raises(ValueError, match="no C\\+\\+ source 'no_such_kernel'"):
        cpp_definition("no_such_kernel", "f")
    with pytest.raises(TypeError, match="source must be"):
        cpp_definition(3, "f")


def test_kernels_of_the_course_are_shown_with_their_line_numbers(capsys):
    show_cpp("flash_naive", "flash_naive_kernel")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "// flash_naive.cu, flash_naive_kernel"
    first = int(out[1].split()[0])
    source = (CUDA_DIR / "flash_naive.cu").read_text().splitlines()
    assert out[1][6:] == source[first - 1] and out[-1][6:] == "}"


PYTHON = """\
import x


def outer(a):
    \"\"\"Not the inner one.\"\"\"
    def helper(b):
        return b
    return helper(a)


@decorator(arg=1)
@another
def helper(c,
           d):
    # a comment inside
    return c + d


class Thing:
    def method(self):
        pass
"""


def test_python_definitions_are_found_by_name_with_their_decorators():
    assert python_definition(PYTHON, "helper") == ("@decorator(arg=1)\n@another\ndef helper(c,\n           d):\n"
                                                   "    # a comment inside\n    return c + d")
    assert python_definition(PYTHON, "outer").endswith("    return helper(a)")
    assert python_definition(PYTHON, "method") == "    def method(self):\n        pass"
    assert python_definition(PYTHON, "Thing").startswith("class Thing:")


def test_python_bad_arguments_are_named():
    with pytest.raises(ValueError, match="no function or class 'x'"):
        python_definition(PYTHON, "x")
    with pytest.raises(ValueError, match="name must be a Python identifier"):
        python_definition(PYTHON, "helper(")
    with pytest.raises(ValueError, match="no Python source"):
        python_definition("no/such/file.py", "f")
    with pytest.raises(TypeError, match="source must be"):
        python_definition(3, "f")


def test_a_gluon_kernel_file_is_shown_by_name_without_importing_it(capsys):
    path = CUDA_DIR.parents[1] / "explicit" / "forward.py"
    show_python(path, "_arrived")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "# forward.py, _arrived" and out[1].endswith("@gluon.jit") and "def _arrived(" in out[2]
    source = path.read_text().splitlines()
    assert all(line[6:] == source[int(line.split()[0]) - 1] for line in out[1:])
    assert out[-1][6:].startswith("    return ")
