from simsched.model import events as ev


def test_order_time_priority_sequence():
    q, seen = ev.EventQueue(), []
    q.handlers = {k: (lambda k: lambda d: seen.append((q.now, k, d)))(k) for k in range(7)}
    q.schedule(2, ev.STEP, "s2")
    q.schedule(1, ev.STEP, "s1")
    q.schedule(1, ev.STORE_DONE, "a")
    q.schedule(1, ev.STORE_DONE, "b")
    assert q.run_until(1) == 3
    assert seen == [(1, ev.STORE_DONE, "a"), (1, ev.STORE_DONE, "b"), (1, ev.STEP, "s1")]
    assert q.step() and not q.step()


def test_sequence_is_per_instance():
    a, b = ev.EventQueue(), ev.EventQueue()
    a.schedule(0, ev.STEP)
    b.schedule(0, ev.STEP)
    assert a._heap[0][2] == b._heap[0][2] == 1
