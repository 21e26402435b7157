"""Schemathesis against /openapi.json: generated requests, valid and invalid, to every operation.

The app runs as deployed (its lifespan starts a model worker process with the tiny model) and
schemathesis calls it in-process. Every check it knows runs on every answer: no 5xx, status codes,
content types, headers and bodies as the document declares them, and schema-violating requests
rejected. A fixed seed makes the few hundred cases the same in every run, so that a failure
reproduces. (The shedding 503s need load, which is benchmarks/overload.py's business; here the
queue never fills.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.config._checks import (
    NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES,
    POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES,
)
from schemathesis.python import asgi
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.schemas import OpenApiSchema

from app.main import create_app
from tests.test_api import make_settings

# At most, per operation and mode. The GETs without parameters have one case each; /translate gets
# 150 valid and 150 invalid bodies (JSON, urlencoded, multipart): ~15 s on 2 cores.
CASES_PER_OPERATION = 120


@pytest.fixture(scope="module")
def api(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenApiSchema]:
    # Small limits, so that generated bodies reach them (413) as well as the model.
    limits = {
        "max_texts": 8,
        "max_chars": 400,
        "max_alternatives": 2,
        "max_beam_size": 4,
        "default_beam_size": 2,
    }
    data_dir = tmp_path_factory.mktemp("data")  # where generated glossaries and memories are stored
    # A key holds 3 jobs at most: the generated uploads beyond are refused (429), not read.
    # shared_stores: without keys, /glossaries, /memories and GET /jobs would all be 403s.
    settings = make_settings(model_dir, data_dir=data_dir, max_jobs_per_key=3, shared_stores=True, **limits)
    app = create_app(settings)
    # Starts the app's lifespan. A schema-valid request may still be too large (413): the limits
    # summed over a list of texts have no JSON Schema keyword. And 413 is a rejection too.
    accepted = [*POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES, "413"]
    rejected = [*NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES, "413"]
    checks = {
        "positive_data_acceptance": {"expected-statuses": accepted},
        "negative_data_rejection": {"expected-statuses": rejected},
    }
    # A file's format and content are beyond JSON Schema: a schema-valid upload may still be of no
    # format the service reads (400); a job is made at once, and may fail later.
    files = {
        "include-path-regex": "^/(translate_file|jobs)$",
        "checks": {"positive_data_acceptance": {"expected-statuses": [*accepted, "400"]}},
    }
    # A stored glossary's or memory's entries have rules beyond JSON Schema too (no source twice, no
    # control character), a TSV memory needs its languages, and the keys' stores fill up (409).
    stores = {
        "include-path-regex": "^/(glossaries|memories)",
        "checks": {"positive_data_acceptance": {"expected-statuses": [*accepted, "400", "409", "422"]}},
    }
    # DeepL's API (/v2): its language codes are any case, with variants (EN-US), so the document
    # does not list them; an unserved one is DeepL's 400, as is a table or a document refused.
    deepl = {
        "include-path-regex": "^/v2/",
        "checks": {"positive_data_acceptance": {"expected-statuses": [*accepted, "400"]}},
    }
    config = SchemathesisConfig.from_dict({"checks": checks, "operations": [files, stores, deepl]})
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=config)
    yield schema
    asgi.shutdown_lifespans()  # stops the worker process


def run_cases(operation: APIOperation, mode: GenerationMode) -> None:
    """``CASES_PER_OPERATION`` generated requests to ``operation``, each answer checked; a fifth of
    them to the jobs' operations (/jobs, DeepL's /v2/document): a generated id names no job (each
    answer is the same 404), and a job's upload is /translate_file's form, fuzzed in full there."""
    fifth = operation.path.startswith(("/jobs", "/v2/document"))
    cases = CASES_PER_OPERATION // 5 if fifth else CASES_PER_OPERATION

    @seed(20261123)
    @settings(
        max_examples=cases,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,  # no example database: the seed alone decides what runs
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the failing case is reported as is
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate()

    check()


# (schemathesis's own pytest plugin, ``from_fixture``, does not run under pytest 9, hence this loop.)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms_to_its_openapi_document(api: OpenApiSchema, mode: GenerationMode) -> None:
    operations = [result.ok() for result in api.get_all_operations()]
    paths = {op.path for op in operations}
    assert {
        "/translate",
        "/detect",
        "/translate_file",
        "/download_file/{filename}",
        "/frontend/settings",
        "/spec",
        "/glossaries",
        "/glossaries/{glossary_id}",
        "/memories",
        "/jobs",
        "/jobs/{job_id}",
        "/jobs/{job_id}/result",
        "/v2/translate",
        "/v2/document",
        "/v2/document/{document_id}",
        "/v2/document/{document_id}/result",
        "/v2/glossaries",
        "/v2/glossaries/{glossary_id}",
        "/v2/glossaries/{glossary_id}/entries",
        "/v2/glossary-language-pairs",
        "/v2/languages",
        "/v2/usage",
    } <= paths
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not operation.body and not operation.query:
            continue  # nothing to make invalid in a GET without parameters
        run_cases(operation, mode)


def test_openapi_documents_languages_and_errors(api: OpenApiSchema) -> None:
    """The document names the served codes (so the generator sends both supported and unsupported
    ones) and the errors /translate can answer with."""
    document = api.raw_schema
    post = document["paths"]["/translate"]["post"]
    for media in post["requestBody"]["content"].values():
        fields = media["schema"]["properties"]
        assert fields["source"]["enum"] == ["auto", "de"]
        assert fields["target"]["enum"] == ["en"]
    assert {"200", "400", "403", "413", "422", "503", "504"} <= set(post["responses"])
    upload = document["paths"]["/translate_file"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert upload["schema"]["properties"]["source"]["enum"] == ["auto", "de"]
    assert upload["schema"]["properties"]["target"]["enum"] == ["en"]
    assert "/" not in document["paths"]  # the page is no API operation
    assert "503" in document["paths"]["/health"]["get"]["responses"]
