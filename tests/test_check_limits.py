"""tests/check_limits.py's count of code lines: docstrings, comments and blank lines left out, every
other line counted, a string that is no docstring included."""

from tests.check_limits import code_lines

SOURCE = '''"""The module's docstring,
over two lines."""

import os  # a comment after code


# a comment line
class Box:
    """A class docstring."""

    size = 3

    def area(self):
        """A function's docstring,

        with a blank line inside."""
        text = """a multi-line string
that is not a docstring"""
        return (self.size
                # a comment inside the expression
                * 2)


def one_line(): "a docstring on the def's line"
'''


def test_code_lines_leave_out_docstrings_comments_and_blank_lines():
    """Each line of a made-up module, by what it holds: the code lines are exactly those with a
    statement or an expression's piece, the lines of a string that is not a docstring among them."""
    assert code_lines(SOURCE) == {4, 8, 11, 13, 17, 18, 19, 21, 24}
