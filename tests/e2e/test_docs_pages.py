"""docs/*.md's ```bash and ```python blocks run as written, with the harness of test_docs_examples.py
(which runs the README's): a file of its own so that parallel test workers run the two at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_docs_examples import DOCUMENTS, Reader, documents_with_blocks, reader, run_document

__all__ = ["reader"]  # the fixture, used by name


@pytest.mark.parametrize("document", documents_with_blocks(DOCUMENTS[1:]), ids=lambda doc: doc.name)
def test_document_runs_as_written(document: Path, reader: Reader) -> None:  # noqa: F811 (the fixture)
    run_document(document, reader)
