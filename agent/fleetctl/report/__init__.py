"""Rendering results for people: terminal tables (Rich), the inspect JSON document, the HTML report.

Data flows one way into this room: engine results and history records in, text out. Nothing
here reaches a host or writes state.
"""
