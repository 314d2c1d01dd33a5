"""Adapters for the frameworks people already train with, each an optional extra.

``ampguard.integrations.<name>`` imports its framework when it is imported, never before:
``import ampguard`` stays light. Each module says which extra installs what it needs
(``pip install 'ampguard[lightning]'``) and raises one clear ``ImportError`` when it is missing.
"""
