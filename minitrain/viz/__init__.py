"""Widgets for the lessons.  Each module keeps what to draw in pure, tested functions; the widget
classes only wire ipywidgets controls to them."""

#: ipywidgets ``style`` sizing a control's label to its text (the default width cuts long labels)
LABEL = {"description_width": "initial"}


def beside():
    """A layout keeping a ToggleButtons' label beside its buttons (ipywidgets 8 puts it above)."""
    import ipywidgets as w

    return w.Layout(display="flex", flex_flow="row", align_items="center", width="auto")
