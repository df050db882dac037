"""The OpenAI-compatible server of `16_server` as its clients meet it: the official `openai` package for completions,
chat, streaming and errors; greedy text equal to `LLM.generate`'s; 64 concurrent streaming clients, after which the
pool has every block back and /metrics agrees with what the clients counted; clients that hang up; a failing engine
step; one table of bad inputs, each a 400 naming its field; the load generator; Ctrl-C on `serve` in a subprocess.
The server runs on 127.0.0.1 on a free port, its engine on the PyTorch kernels (the Triton interpreter, which CI
switches on, would take minutes a step)."""
import argparse, asyncio, json, signal, subprocess, sys, time
from pathlib import Path
import httpx, openai, pytest, torch
from dsv41_nb.checkpoint import load_model
from dsv41_nb.engine import LLM
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.server import (OpenAIServer, ServerThread, parse_metrics, run_bench, bench_prompts, chat_prompt,
                             add_bench_serve_arguments, bench_serve, add_serve_arguments, serve)

ROOT = Path(__file__).resolve().parent.parent
CKPT = ROOT / 'checkpoints' / 'small'
MODEL, MAX_LEN = 'dsv41-small', 256
torch.set_num_threads(1)            # tensors this small gain nothing from threads, and other processes share the cores
WEIGHTS = load_model(CKPT)
def new_llm(): return LLM(WEIGHTS, kernels='torch', max_model_len=MAX_LEN)


@pytest.fixture(scope='module')
def server():
    st = ServerThread(OpenAIServer(new_llm(), MODEL)).start()
    yield st
    st.stop()
    assert not st.thread.is_alive()


@pytest.fixture(scope='module')
def client(server):
    return openai.OpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=60)


def idle_pool(server, timeout=30):
    "The engine's block pool once the engine holds no request (the loop aborts a leaver at its next pause)"
    eng, t0 = server.server.engine, time.monotonic()
    while eng.has_unfinished_requests() and time.monotonic() - t0 < timeout: time.sleep(0.01)
    assert not eng.has_unfinished_requests()
    return eng.scheduler.kv.block_pool


def metrics(server) -> dict: return parse_metrics(httpx.get(server.url + '/metrics').text)
GREEDY = dict(temperature=0, extra_body={'ignore_eos': True})


def warm(client, prompt):
    """Put the prompt's blocks in the prefix cache: the requests compared below then all read them (a prefix hit can
    flip a near tie of the greedy choice, 13_engine)"""
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)


# ------------------------------------------------------------------------------------------- the server's answers
def test_greedy_completions_equal_llm_generate(server, client):
    "One request at a time, greedy text is LLM.generate's on an engine of its own that saw the same requests"
    ref, sp = new_llm(), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for p in ['Return the', 'def main():', [256] + list(b'Return the'), [[256, 73, 102]]]:
        want = ref.generate(p[0] if isinstance(p[0], list) else p, sp, use_tqdm=False)[0]
        got = client.completions.create(model=MODEL, prompt=p, max_tokens=6, **GREEDY)
        assert got.choices[0].text == want.outputs[0].text, p
        assert (got.choices[0].finish_reason, got.usage.completion_tokens) == ('length', 6)
        assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.object == 'text_completion'


def test_chat_and_streaming(client):
    "Chat is a completion of the chat template; streamed deltas join into the whole answer; usage comes last"
    msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Name a colour.'}]
    template = chat_prompt([('system', 'Be brief.'), ('user', 'Name a colour.')])
    warm(client, template); warm(client, 'Return the')
    ask = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={'include_usage': True}))
    assert (whole.object, chunks[0].object) == ('chat.completion', 'chat.completion.chunk')
    assert chunks[0].choices[0].delta.role == 'assistant'
    text = ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    plain = client.completions.create(model=MODEL, prompt=template, max_tokens=6, temperature=0)
    assert plain.choices[0].text == whole.choices[0].message.content
    streamed = client.completions.create(model=MODEL, prompt='Return the', max_tokens=6, stream=True, **GREEDY)
    once = client.completions.create(model=MODEL, prompt='Return the', max_tokens=6, **GREEDY)
    assert ''.join(c.choices[0].text for c in streamed) == once.choices[0].text


def test_sampling_fields(client):
    "A seed repeats a random answer; top_k 1 is greedy; a stop string cuts the text before it, finish reason 'stop'"
    def text(**kw): return client.completions.create(model=MODEL, prompt='If the', max_tokens=6, **kw).choices[0]
    warm(client, 'If the')
    seeded = dict(temperature=1.0, top_p=0.9, seed=11, extra_body={'min_p': 0.01, 'ignore_eos': True})
    assert text(**seeded).text == text(**seeded).text
    greedy = text(**GREEDY).text
    assert text(temperature=1.0, extra_body={'top_k': 1, 'ignore_eos': True}).text == greedy
    stop = greedy[3:5]
    cut = text(temperature=0, stop=[stop, 'never appears'])
    assert (cut.text, cut.finish_reason) == (greedy.split(stop)[0], 'stop')


def test_models_health_page(server, client):
    assert [(m.id, m.object) for m in client.models.list().data] == [(MODEL, 'model')]
    assert httpx.get(server.url + '/health').status_code == 200
    page = httpx.get(server.url + '/')
    assert page.status_code == 200 and page.headers['content-type'].startswith('text/html')
    for part in (f'<title>{MODEL}</title>', "fetch('/v1/completions'", "fetch('/metrics')", 'AbortController'):
        assert part in page.text, part


# ------------------------------------------------------------------------------------------------ bad input
C, CHAT = '/v1/completions', '/v1/chat/completions'
def chat(content, **kw): return {'messages': [{'role': 'user', 'content': content}]} | kw
FIELDS = [({'max_tokens': 1000}, 'max_tokens', "'max_tokens' is too large: 1000"),
          ({'max_tokens': 0}, 'max_tokens', '= 0'), ({'max_tokens': 2.5}, 'max_tokens', 'must be an integer'),
          ({'max_tokens': '8'}, 'max_tokens', 'an integer'), ({'temperature': -1}, 'temperature', 'temperature = -1'),
          ({'temperature': 'hot'}, 'temperature', 'a number'), ({'temperature': True}, 'temperature', 'a number'),
          ({'top_p': 0}, 'top_p', 'top_p = 0'), ({'top_p': 1.5}, 'top_p', 'top_p = 1.5'),
          ({'top_k': -2}, 'top_k', 'top_k = -2'), ({'min_p': 2}, 'min_p', 'min_p = 2'),
          ({'seed': 2 ** 70}, 'seed', 'does not fit in 64 bits'), ({'seed': 'x'}, 'seed', 'an integer'),
          ({'n': 2}, 'n', 'one choice per request'), ({'stop': [1]}, 'stop', "'stop' must be"),
          ({'stop': ''}, 'stop', 'non-empty'), ({'stream': 'yes'}, 'stream', 'a boolean'),
          ({'stop_token_ids': [999]}, 'stop_token_ids', 'stop token id 999'),
          ({'stop_token_ids': 5}, 'stop_token_ids', 'a list'),
          ({'min_tokens': 20, 'max_tokens': 4}, 'min_tokens', '= 20'), ({'logprobs': 2}, 'logprobs', 'not supported'),
          ({'echo': True}, 'echo', 'not supported'), ({'best_of': 2}, 'best_of', 'not supported'),
          ({'ignore_eos': 'no'}, 'ignore_eos', 'a boolean'),
          ({'stream_options': {'include_usage': 1}}, 'stream_options.include_usage', 'a boolean')]
BAD = ([(C, b'{"prompt": "a",', None, 'not valid JSON'), (C, b'', None, 'not valid JSON'),
        (C, b'\xff\xfe', None, 'not valid JSON'), (C, b'[1, 2]', None, 'a JSON object'),
        (C, b'{"prompt": "a", "temperature": NaN}', None, 'NaN is not a JSON value'),
        (C, b'{"prompt": "a", "top_p": Infinity}', None, 'Infinity is not a JSON value'),
        (C, {'model': 'gpt-4', 'prompt': 'a'}, 'model', 'The model `gpt-4` does not exist'),
        (C, {'model': 3, 'prompt': 'a'}, 'model', 'must be a string'),
        (C, {}, 'prompt', "'prompt' must be a string or a list of token ids"), (C, {'prompt': 3}, 'prompt', 'got 3'),
        (C, {'prompt': ''}, 'prompt', 'empty'), (C, {'prompt': []}, 'prompt', 'empty'),
        (C, {'prompt': ['a', 'b']}, 'prompt', '2 prompts'), (C, {'prompt': [1, 512]}, 'prompt', 'token id 512 at'),
        (C, {'prompt': [-1]}, 'prompt', 'token id -1'), (C, {'prompt': [1, True]}, 'prompt', 'list of token ids'),
        (C, {'prompt': 'x' * MAX_LEN}, 'prompt', f'more than max_model_len = {MAX_LEN}'),
        (C, {'prompt': [7] * MAX_LEN}, 'prompt', 'fill max_model_len'),
        (CHAT, {}, 'messages', 'non-empty list'), (CHAT, {'messages': []}, 'messages', 'non-empty'),
        (CHAT, {'messages': ['hi']}, 'messages[0]', 'must be an object'),
        (CHAT, {'messages': [{'role': 'robot', 'content': 'x'}]}, 'messages[0].role', 'must be one of'),
        (CHAT, chat(3), 'messages[0].content', 'must be a string'),
        (CHAT, chat([{'type': 'text', 'text': 4}]), 'messages[0].content', 'text parts'),
        (CHAT, chat('x' * MAX_LEN), 'messages', 'max_model_len'),
        (CHAT, chat('hi', max_completion_tokens=999), 'max_completion_tokens', 'too large'),
        (CHAT, chat('hi', model='nope'), 'model', 'does not exist')]
       + [(C, {'prompt': 'a'} | body, param, msg) for body, param, msg in FIELDS])


def test_bad_input_table(server):
    "Every row: HTTP 400, an OpenAI-style error whose param names the field; the server serves on afterwards"
    free0 = idle_pool(server).get_num_free_blocks()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for path, body, param, msg in BAD:
            r = c.post(path, **({'content': body} if isinstance(body, bytes) else {'json': body}))
            err = r.json().get('error', {})
            assert (r.status_code, err.get('param'), err.get('type')) == (400, param, 'invalid_request_error'), r.text
            assert msg in err['message'] and err['code'] in (400, 'model_not_found'), (body, msg, r.text)
        assert c.get('/health').status_code == 200
        ok = c.post('/v1/completions', json={'prompt': 'a', 'max_tokens': 2}).json()
        assert ok['usage']['completion_tokens'] == 2
    assert idle_pool(server).get_num_free_blocks() == free0             # refused requests left nothing behind


def test_openai_client_errors(client):
    "The openai package raises BadRequestError with the field, for the errors above"
    for kw, param in [(dict(model='nope'), 'model'), (dict(n=2), 'n'), (dict(temperature=-0.5), 'temperature'),
                      (dict(max_tokens=10 ** 6), 'max_tokens'), (dict(extra_body={'top_k': -3}), 'top_k')]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**(dict(model=MODEL, prompt='a') | kw))
        assert (e.value.status_code, e.value.param, e.value.type) == (400, param, 'invalid_request_error')


# ------------------------------------------------------------------------------------------------ load and leaving
def test_64_concurrent_streams_then_every_block_free_and_metrics_agree(server):
    "64 streaming clients at once, 4 tokens each; afterwards the pool is whole and /metrics counts what they counted"
    before, t0 = metrics(server), time.monotonic()
    async def one(c, i):
        stream = await c.completions.create(model=MODEL, prompt=f'request {i} says', max_tokens=4, temperature=0.8,
                                            seed=i, stream=True, stream_options={'include_usage': True},
                                            extra_body={'ignore_eos': True})
        chunks = [ch async for ch in stream]
        return chunks[-1].usage, [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    async def all64():
        async with openai.AsyncOpenAI(base_url=server.url + '/v1', api_key='unused', max_retries=0, timeout=60) as c:
            return await asyncio.gather(*[one(c, i) for i in range(64)])
    got = asyncio.run(all64())
    assert time.monotonic() - t0 < 60
    pool = idle_pool(server)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    after = metrics(server)
    grew = lambda k: after[k] - before.get(k, 0)
    assert [f for _, f in got] == ['length'] * 64 and [u.completion_tokens for u, _ in got] == [4] * 64
    assert grew('vllm:generation_tokens_total') == sum(u.completion_tokens for u, _ in got) == 256
    assert grew('vllm:prompt_tokens_total') == sum(u.prompt_tokens for u, _ in got)
    assert grew('vllm:e2e_request_latency_seconds_count') == grew('vllm:time_to_first_token_seconds_count') == 64
    assert grew('vllm:time_per_output_token_seconds_count') == 64 * 3
    assert grew('vllm:request_success_total{finished_reason="length"}') == 64
    gauges = ('vllm:num_requests_running', 'vllm:num_requests_waiting', 'vllm:kv_cache_usage_perc')
    assert [after[k] for k in gauges] == [0, 0, 0]
    assert grew('vllm:prefix_cache_queries_total') == sum(u.prompt_tokens - 1 for u, _ in got)   # one lookup each
    assert after['vllm:num_preemptions_total'] == 0


def test_client_that_hangs_up_aborts_its_request(server):
    "A streaming client that leaves after one chunk, and a waiting client that times out: both requests are aborted"
    pool, aborts = idle_pool(server), metrics(server).get('vllm:request_success_total{finished_reason="abort"}', 0)
    body = dict(model=MODEL, prompt='Once upon a time', max_tokens=200, ignore_eos=True)
    with httpx.stream('POST', server.url + '/v1/completions', json=body | {'stream': True}, timeout=60) as r:
        assert next(l for l in r.iter_lines() if l.startswith('data: '))
    assert idle_pool(server).get_num_free_blocks() == pool.num_usable_blocks
    with pytest.raises(httpx.ReadTimeout): httpx.post(server.url + '/v1/completions', json=body, timeout=0.5)
    assert idle_pool(server).get_num_free_blocks() == pool.num_usable_blocks
    assert metrics(server)['vllm:request_success_total{finished_reason="abort"}'] == aborts + 2


def test_a_failing_step_ends_its_requests_and_the_server_goes_on(server, monkeypatch):
    "A step that raises: a 500 (or an error event in a stream) for the requests in it; the next request is served"
    engine, calls = server.server.engine, []
    def broken(*a):
        calls.append(1)
        raise RuntimeError('the device fell over')
    monkeypatch.setattr(engine, 'step', broken)
    r = httpx.post(server.url + '/v1/completions', json={'prompt': 'a', 'max_tokens': 3}, timeout=60)
    assert r.status_code == 500 and 'the device fell over' in r.json()['error']['message']
    with httpx.stream('POST', server.url + '/v1/completions', json={'prompt': 'a', 'stream': True}, timeout=60) as r:
        events = [l[6:] for l in r.iter_lines() if l.startswith('data: ')]
    assert 'the device fell over' in json.loads(events[-2])['error']['message'] and events[-1] == '[DONE]'
    monkeypatch.undo()
    assert httpx.post(server.url + '/v1/completions', json={'prompt': 'a', 'max_tokens': 2}).status_code == 200
    assert idle_pool(server).get_num_free_blocks() == idle_pool(server).num_usable_blocks and len(calls) == 2


# ------------------------------------------------------------------------------------------------ the load generator
def test_bench_serve_against_the_server(server, capsys, tmp_path):
    s = asyncio.run(run_bench(server.url, bench_prompts(8, 24), max_tokens=3, max_concurrency=4, ignore_eos=True))
    assert (s['completed'], s['failed'], s['output_tokens'], s['input_tokens'], s['model']) == (8, 0, 24, 8 * 25, MODEL)
    assert s['ttft_s']['p50'] > 0 and s['tpot_s']['p99'] >= s['tpot_s']['p50'] > 0 and s['itl_s']['mean'] > 0
    args = add_bench_serve_arguments(argparse.ArgumentParser()).parse_args(
        ['--base-url', server.url, '--num-prompts', '4', '--max-tokens', '2', '--request-rate', '50', '--ignore-eos',
         '--json', str(tmp_path / 'b.json')])
    assert bench_serve(args) == 0
    out = capsys.readouterr().out
    assert f'{MODEL}: 4 requests completed, 0 failed (50 req/s' in out and 'TTFT' in out and 'ITL' in out
    assert json.loads((tmp_path / 'b.json').read_text())['output_tokens'] == 8


def test_serve_flags():
    p = add_serve_arguments(argparse.ArgumentParser())
    a = p.parse_args([])
    assert (a.host, a.port, a.device, a.checkpoint, a.max_num_seqs, a.max_model_len, a.async_scheduling) == (
        '127.0.0.1', 8000, 'cpu', None, 256, None, False)
    def error(msg): raise ValueError(msg)
    with pytest.raises(ValueError, match="--device 'tpu'"):
        serve(p.parse_args(['--device', 'tpu', '--port', '0']), error)
    with pytest.raises(ValueError, match='no config.json'):
        serve(p.parse_args(['--checkpoint', str(ROOT / 'nowhere'), '--port', '0']), error)


def test_ctrl_c_aborts_what_is_in_flight_and_exits_quietly():
    "`serve` in its own process: Ctrl-C mid-stream ends the stream with finish reason 'abort' and [DONE], exit 0"
    code = ("import argparse, sys; from dsv41_nb.server import add_serve_arguments, serve; "
            "sys.exit(serve(add_serve_arguments(argparse.ArgumentParser()).parse_args(sys.argv[1:])))")
    p = subprocess.Popen([sys.executable, '-c', code, '--port', '0', '--kernels', 'torch', '--max-model-len', '256',
                          '--log-level', 'warning'], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = p.stderr.readline()
        assert line.startswith('serving dsv41-small'), line + p.stderr.read()
        url, events = line.split(' at ')[-1].strip(), []
        body = dict(prompt='Once upon a time', max_tokens=200, ignore_eos=True, stream=True)
        with httpx.stream('POST', url + '/v1/completions', json=body, timeout=60) as r:
            for l in (l for l in r.iter_lines() if l.startswith('data: ')):
                events.append(l[6:])
                if len(events) == 2: p.send_signal(signal.SIGINT)        # once, mid-stream
        assert events[-1] == '[DONE]' and json.loads(events[-2])['choices'][0]['finish_reason'] == 'abort'
        assert p.wait(60) == 0
        err = p.stderr.read()
        assert 'Traceback' not in err, err
    finally:
        if p.poll() is None: p.kill()


def test_the_page_in_a_browser(server):
    "The page at /: Generate streams an answer and its token count in; Stop aborts the request on the server"
    from test_docs_site import Chromium, find_chromium          # the docs site's headless Chromium, over DevTools
    if not (exe := find_chromium()): pytest.skip('no Chromium here')
    b = Chromium(exe)
    def wait(js, timeout=30):
        t0 = time.monotonic()
        while not b.evaluate(js):
            assert time.monotonic() - t0 < timeout, js
            time.sleep(0.1)
    try:
        assert b.open(server.url + '/') == []                      # no script error, nothing missing
        b.evaluate("document.getElementById('maxtok').value = 5; document.getElementById('go').click()")
        wait("document.getElementById('stat').textContent.startsWith('5 tokens in')")
        assert b.evaluate("document.getElementById('out').textContent") != ''
        wait("document.getElementById('metrics').innerText.includes('requests finished')")
        b.evaluate("document.getElementById('maxtok').value = 200; document.getElementById('go').click()")
        wait("document.getElementById('out').textContent.length > 0")
        b.evaluate("document.getElementById('stop').click()")
        wait("document.getElementById('stat').textContent === 'stopped'")
        pool = idle_pool(server)
        assert pool.get_num_free_blocks() == pool.num_usable_blocks
    finally:
        b.close()


@pytest.mark.parametrize('argv, usage', [(['serve', '--help'], 'serve'), (['bench', 'serve', '--help'], 'bench serve')])
def test_the_command_line_has_serve_and_bench_serve(argv, usage):
    "`dsv41 serve` and `dsv41 bench serve` (spelt as vLLM spells them) reach the server's own parsers"
    r = subprocess.run([sys.executable, '-m', 'dsv41_nb', *argv], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.startswith(f'usage: python -m dsv41_nb {usage} '), r.stdout + r.stderr
