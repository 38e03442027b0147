"""The POST flow: the one method flow under its historical name (POST's stages live in
``tasks/methods/post.py``)."""

from flows.method_flow import method_flow

post_flow = method_flow
