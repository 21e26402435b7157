"""DeepL's API v2 on the same service, so that tools wired to DeepL change one URL: texts, usage
and languages (``texts``), documents over the jobs (``documents``), glossaries over the stored ones
(``glossaries``), all in ``api``. DeepL's language codes are mapped onto the served ones
(``codes``), its refusals answered as DeepL answers them (``errors``). What each DeepL field does
here: docs/deepl.md.
"""

from app.http.endpoints.deepl import documents, glossaries, texts

api = texts.api
api.include_router(documents.api)
api.include_router(glossaries.api)
