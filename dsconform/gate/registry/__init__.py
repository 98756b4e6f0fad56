"""The known-issue registry's entries, one module per family of suites; each module's
``ISSUES`` is a tuple of :class:`~dsconform.gate.known_issue.KnownIssue`. The rules that apply
to every entry are in dsconform/gate/known_issues.py."""
