"""Malformed QA files: every error names the file, and for a bad record its 1-based row.

The table lives in `treegrpo_jax.testing.bad_inputs` (the resilience benchmark counts it too).
"""

import pytest

from treegrpo_jax.data.readers import read_rows
from treegrpo_jax.testing.bad_inputs import BAD_DATA, data_error, data_is_clear


@pytest.mark.parametrize("case", BAD_DATA, ids=lambda c: c.name)
def test_malformed_file_is_reported_with_file_and_row(case, tmp_path):
    message = data_error(case, tmp_path)
    assert message is not None, f"{case.name} was read without complaint"
    assert data_is_clear(case, message, tmp_path), message


@pytest.mark.parametrize("case", [c for c in BAD_DATA if c.row is not None], ids=lambda c: c.name)
def test_skip_bad_rows_counts_the_row_instead(case, tmp_path):
    path = tmp_path / f"{case.name}{case.suffix}"
    case.write(path)
    result = read_rows([path], skip_bad_rows=True)
    assert result.bad_rows and result.bad_rows[0].row_number == case.row
    assert str(result.bad_rows[0]).startswith(f"{path}:{case.row}:")
