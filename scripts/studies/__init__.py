"""Studies: runs and the tables they store under eval/reference/, run from the repository root as modules
(``python -m scripts.studies.NAME``) and importing each other as modules (``from scripts.studies.onpolicy_study
import summarize``). spectrain itself is imported as the installed package (``pip install -e .``)."""
