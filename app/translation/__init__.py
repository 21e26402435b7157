"""The use case "translate these texts", with no HTTP in it: one request in, one result out.

- ``texts``: a request's texts, stage by stage (check, terminology, split, answer, render):
  ``TextRequest`` -> ``TextResult`` (``Translations.texts``);
- ``sentences``: the stage that answers sentences (memory, cache, then the model), which documents
  and jobs call for their sentences: ``SentenceRequest`` -> ``SentenceResult`` per sentence;
- ``documents``: a document read, translated a chunk at a time, written: ``DocumentRequest`` in,
  the translated file out, or its stages one by one for a job;
- ``languages``: which route (the model path) translates a pair, and a text's language when the
  source is "auto"; ``codes``: language codes and names; ``langid``: the detector;
- ``segments``: a text cut into sentences and put back; ``results``: what it answers beside text;
- ``errors``: its refusals, which each caller maps (HTTP: ``app.http.errors.TRANSLATION_STATUS``).

The endpoints (``app.http.endpoints``: LibreTranslate's and DeepL's) and the jobs' runner parse,
call it, and map its errors; ``import-linter`` checks that nothing of HTTP is imported here.
"""
