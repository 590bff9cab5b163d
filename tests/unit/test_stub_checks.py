from backends.triton.stub_checks import numpy_refusal


def test_numpy_1_is_accepted():
    assert numpy_refusal("1.26.4", "/venv/numpy/__init__.py") is None


def test_numpy_2_is_refused_with_where_it_came_from_and_the_fix():
    message = numpy_refusal("2.4.6", "/usr/lib/python3/site-packages/numpy/__init__.py")
    assert "numpy 2.4.6" in message
    assert "/usr/lib/python3/site-packages/numpy/__init__.py" in message
    assert "EASEL_SERVER_PYTHONPATH" in message
