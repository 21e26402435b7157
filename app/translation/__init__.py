"""The use case "translate these texts", with no HTTP in it: one request in, one result out.

- ``texts``: a request's texts, stage by stage (check, terminology, split, answer, render):
  ``TextRequest`` -> ``TextResult`` (``Translations.texts``);
- ``sentences``: the stage that answers sentences (memory, cache, then the model), which documents
  and jobs call for their sentences: ``SentenceRequest`` -> ``SentenceResult`` per sentence;
- ``languages``: which route translates a pair, and a text's language when the source is "auto";
- ``errors``: its refusals, which each caller maps (HTTP: ``app.http.errors.TRANSLATION_STATUS``).

The routes (``app.http.routes.translate``, ``app.http.routes.files``) and the jobs' runner parse, call it, and
map its errors; ``import-linter`` checks that nothing of HTTP is imported here.
"""
