"""The OpenAI-compatible server of `16a_http_server` as its clients meet it: the official `openai` package for
completions, chat, streaming and errors; greedy text equal to `LLM.generate`'s; 64 concurrent streaming clients,
after which the pool has every block back and /metrics agrees with what the clients counted; clients that hang up; a
failing engine step; one table of bad inputs, each a 400 naming its field, and one of bad calls to the functions of
`16_server_api`, each a TypeError or ValueError naming its argument; the load generator and Ctrl-C on `serve` in a
subprocess (both `16b_serve_cli`).
Then `serve --data-parallel-size 2` (spawned ranks) and `serve` under torchrun, each in a process group of its own
(marked `processes`): concurrent greedy answers equal the one-process engine's, requests on both ranks, streaming, a
client that hangs up on one rank while the other rank's request goes on, no blocks left held, and Ctrl-C ending every
rank; and a table of bad flags, refused before any rank starts.
The server runs on 127.0.0.1 on a free port, its engine on the PyTorch kernels (the Triton interpreter, which CI
switches on, would take minutes a step)."""
import argparse, asyncio, json, os, selectors, signal, subprocess, sys, time
from pathlib import Path
from types import SimpleNamespace
import httpx, openai, pytest, torch
from dsv41_nb.checkpoint_files import load_model
from dsv41_nb.distributed import free_port
from dsv41_nb.engine import LLM
from dsv41_nb.scheduler import SamplingParams
from dsv41_nb.server import AsyncEngine
from dsv41_nb.server_api import (APIError, field, sampling_params, completion_prompt, chat_messages, chat_prompt,
                                 choice, response, usage, sse, ServerMetrics, parse_metrics)
from dsv41_nb.http_server import OpenAIServer, ServerThread
from dsv41_nb.serve_cli import (run_bench, bench_prompts, add_bench_serve_arguments,
                                bench_serve, add_serve_arguments, serve)

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
    flip a near tie of the greedy choice, 13_engine_runs)"""
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



def bare_front(): return AsyncEngine(SimpleNamespace())      # a front that is never started: its engine is not read
BAD_CALLS = [
    (lambda: field([1], 'n', 'an integer'), TypeError, 'field: body must be a dict'),
    (lambda: field({}, 'n', 'an int'), ValueError, "field: kind = 'an int'; expected one of"),
    (lambda: field({}, 'n', ['an integer']), ValueError, "field: kind = ['an integer']"),
    (lambda: sampling_params('{}', 10, 256, 512), TypeError, 'sampling_params: body must be a dict'),
    (lambda: sampling_params({}, 0, 256, 512), ValueError, 'sampling_params: n_prompt = 0; expected at least 1'),
    (lambda: sampling_params({}, 10, 256.0, 512), TypeError, 'sampling_params: max_model_len must be an int'),
    (lambda: sampling_params({}, 10, 256, 0), ValueError, 'sampling_params: vocab_size = 0'),
    (lambda: sampling_params({}, 10, 256, 512, 0), ValueError, 'sampling_params: default_max_tokens = 0'),
    (lambda: sampling_params({}, 10, 256, 512, True), TypeError, 'default_max_tokens must be an int'),
    (lambda: completion_prompt(None), TypeError, 'completion_prompt: body must be a dict'),
    (lambda: chat_messages([]), TypeError, 'chat_messages: body must be a dict'),
    (lambda: chat_prompt('user: hi'), TypeError, 'chat_prompt: messages must be a list of (role, text) pairs'),
    (lambda: chat_prompt([('user', 3)]), TypeError, 'chat_prompt: messages must be'),
    (lambda: chat_prompt([('user', 'a', 'b')]), TypeError, 'chat_prompt: messages must be'),
    (lambda: choice(b'a', None, False, False), TypeError, 'choice: text must be a str, got bytes'),
    (lambda: choice('a', 1, False, False), TypeError, 'choice: finish must be a str or None'),
    (lambda: choice('a', None, 1, False), TypeError, 'choice: chat must be a bool'),
    (lambda: choice('a', None, False, None), TypeError, 'choice: stream must be a bool'),
    (lambda: response(1, 'm', 0, [], False, False), TypeError, 'response: rid must be a str'),
    (lambda: response('r', None, 0, [], False, False), TypeError, 'response: model must be a str'),
    (lambda: response('r', 'm', -1, [], False, False), ValueError, 'response: created = -1'),
    (lambda: response('r', 'm', 0, {}, False, False), TypeError, 'response: choices must be a list'),
    (lambda: response('r', 'm', 0, [], False, 'yes'), TypeError, 'response: stream must be a bool'),
    (lambda: usage(-1, 0), ValueError, 'usage: n_prompt = -1'),
    (lambda: usage(1, 2.0), TypeError, 'usage: n_out must be an int'),
    (lambda: sse(object()), TypeError, 'not JSON serializable'),
    (lambda: APIError(3), TypeError, 'APIError: message must be a str'),
    (lambda: APIError('x', 7), TypeError, 'APIError: param must be a str or None'),
    (lambda: APIError('x', status=200), ValueError, 'APIError: status = 200'),
    (lambda: APIError('x', status='400'), TypeError, "APIError: status must be an int, got str '400'"),
    (lambda: ServerMetrics('front', 'm'), TypeError, 'ServerMetrics: front must be an AsyncEngine'),
    (lambda: ServerMetrics(bare_front(), ''), ValueError, 'ServerMetrics: model_name is empty'),
    (lambda: ServerMetrics(bare_front(), None), TypeError, 'ServerMetrics: model_name must be a str'),
    (lambda: parse_metrics(b'x 1'), TypeError, 'parse_metrics: text must be a str'),
    (lambda: parse_metrics('x{ 1'), ValueError, "parse_metrics: not Prometheus' text format"),
]


@pytest.mark.parametrize('f,exc,msg', BAD_CALLS, ids=[m for *_, m in BAD_CALLS])
def test_bad_calls_to_the_protocol_functions(f, exc, msg):
    "Each row: the exception's type, and a message naming the function and the argument"
    with pytest.raises(exc) as e: f()
    assert msg in str(e.value), str(e.value)


def test_the_protocol_functions_take_what_the_server_hands_them():
    "The checks refuse nothing the server passes: a request's parts, a chunk and its event, and the metrics' text"
    sp, stops = sampling_params({'stop': 'END', 'max_tokens': 4}, 3, MAX_LEN, 512, None)
    assert (sp.max_tokens, stops) == (4, ['END'])
    assert completion_prompt({'prompt': [[1, 2]]}) == [1, 2]
    assert chat_prompt(chat_messages(chat('hi'))) == 'user: hi\nassistant:'
    r = response('cmpl-1', MODEL, 0, [choice('a', None, True, True)], True, True, usage=usage(3, 0))
    assert json.loads(sse(r)[6:]) == r and r['object'] == 'chat.completion.chunk'
    assert sse('[DONE]') == 'data: [DONE]\n\n'
    assert APIError('busy', None, 503, 'service_unavailable').body()['error']['code'] == 503
    met = ServerMetrics(AsyncEngine(new_llm()), MODEL)
    assert parse_metrics(met.render().decode())['vllm:num_requests_running'] == 0

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
    code = ("import argparse, sys; from dsv41_nb.serve_cli import add_serve_arguments, serve; "
            "sys.exit(serve(add_serve_arguments(argparse.ArgumentParser()).parse_args(sys.argv[1:])))")
    p = subprocess.Popen([sys.executable, '-c', code, '--port', '0', '--kernels', 'torch', '--max-model-len', '256',
                          '--log-level', 'warning'], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = p.stderr.readline()
        if not line.startswith('serving dsv41-small'):     # stopped first: reading a live server's stderr never ends
            p.kill(); pytest.fail(f"expected the 'serving' line first, got: {line}{p.stderr.read()}")
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


# ------------------------------------------------------------------------------------------------ data-parallel ranks
DP_FLAGS = ['serve', '--port', '0', '--kernels', 'torch', '--max-model-len', str(MAX_LEN), '--log-level', 'warning']


def start_serving(cmd, timeout=180):
    "A server process started by `cmd`; (process, URL) once it prints its address (failing, not hanging, without)"
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    with selectors.DefaultSelector() as sel:     # not select(): it refuses descriptors past 1023
        sel.register(p.stderr, selectors.EVENT_READ)
        ready = sel.select(timeout)
    if not ready:
        p.kill()
        pytest.fail(f"no address from {' '.join(cmd[1:])} in {timeout} s; its standard error: {p.stderr.read()}")
    line = p.stderr.readline()
    if ' 2 data-parallel ranks) at http://' not in line:    # stopped first: a live server's stderr never ends
        p.kill(); pytest.fail(f"expected the address line first, got: {line}{p.stderr.read()}")
    return p, line.split(' at ')[-1].strip()


def descendants(pid):
    "Every process below `pid`, read from /proc"
    kids = [int(k) for t in Path(f'/proc/{pid}/task').iterdir() for k in (t / 'children').read_text().split()]
    return kids + [d for k in kids for d in descendants(k)]


def alive(pid):
    try: return Path(f'/proc/{pid}/stat').read_text().split(') ')[1][0] != 'Z'
    except FileNotFoundError: return False


def stop_serving(p, timeout=60):
    "Ctrl-C to the server's process: it and every rank below it end; its exit code and standard error"
    ranks = descendants(p.pid)
    p.send_signal(signal.SIGINT)
    code, err = p.wait(timeout), p.stderr.read()
    t0 = time.monotonic()
    while any(alive(r) for r in ranks) and time.monotonic() - t0 < timeout: time.sleep(0.1)
    assert not any(alive(r) for r in ranks), [r for r in ranks if alive(r)]
    return code, err, ranks


@pytest.fixture(scope='module')
def dp_server():
    p, url = start_serving([sys.executable, '-m', 'dsv41_nb', *DP_FLAGS, '--data-parallel-size', '2'])
    yield p, url
    if p.poll() is None: p.kill()


def engine_metrics(url) -> dict: return parse_metrics(httpx.get(url + '/metrics').text)
def per_rank(m, name): return [m.get(f'vllm:{name}{{engine="{r}"}}', 0) for r in (0, 1)]


def dp_idle(url, timeout=30):
    "/metrics once neither rank runs or waits for a request"
    t0 = time.monotonic()
    while True:
        m = engine_metrics(url)
        if per_rank(m, 'num_requests_running') == per_rank(m, 'num_requests_waiting') == [0, 0]: return m
        assert time.monotonic() - t0 < timeout, m
        time.sleep(0.05)


# prompts that share no first byte, so that no prefix cache hit can flip a near tie between the two servers
DP_PROMPTS = [f'{w} reads the' for w in ('Alice', 'Bob', 'Carol', 'Dan', 'Eve', 'Frank')]


@pytest.mark.processes
def test_dp_server_answers_as_the_one_process_engine(dp_server):
    "Six concurrent greedy requests through the openai client: LLM.generate's text, three placed on each rank"
    _, url = dp_server
    before = dp_idle(url)
    async def six():
        async with openai.AsyncOpenAI(base_url=url + '/v1', api_key='unused', max_retries=0, timeout=120) as c:
            return await asyncio.gather(*[c.completions.create(model=MODEL, prompt=p, max_tokens=6, **GREEDY)
                                          for p in DP_PROMPTS])
    got = [r.choices[0].text for r in asyncio.run(six())]
    want = new_llm().generate(DP_PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert got == [o.outputs[0].text for o in want]
    after = dp_idle(url)
    queried = [a - b for a, b in zip(per_rank(after, 'prefix_cache_queries_total'),
                                      per_rank(before, 'prefix_cache_queries_total'))]
    lens = sorted(len(o.prompt_token_ids) - 1 for o in want)    # one lookup per request, of its prompt less one token
    assert sum(queried) == sum(lens) and min(queried) >= sum(lens[:3]) and max(queried) <= sum(lens[3:])
    assert per_rank(after, 'kv_cache_usage_perc') == [0, 0]
    done = 'vllm:e2e_request_latency_seconds_count'
    assert after[done] - before.get(done, 0) == 6


@pytest.mark.processes
def test_dp_server_streams(dp_server):
    "Streamed chunks join into the whole answer, which is the one-process engine's"
    _, url = dp_server
    c = openai.OpenAI(base_url=url + '/v1', api_key='unused', max_retries=0, timeout=120)
    streamed = c.completions.create(model=MODEL, prompt='Grace said', max_tokens=6, stream=True, **GREEDY)
    pieces = [ch.choices[0].text for ch in streamed]
    want = new_llm().generate('Grace said', SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    assert len(pieces) > 1 and ''.join(pieces) == want


@pytest.mark.processes
def test_dp_client_that_hangs_up_stalls_neither_rank(dp_server):
    """A 200-token stream on one rank; while it runs, a request on the other rank completes; the stream's client
    hangs up: its request is aborted, both pools are whole, and the server serves on"""
    _, url = dp_server
    before = dp_idle(url)
    aborts = before.get('vllm:request_success_total{finished_reason="abort"}', 0)
    body = dict(model=MODEL, prompt='Once upon a time', max_tokens=200, ignore_eos=True, stream=True)
    short = dict(model=MODEL, prompt='Henry wrote', max_tokens=8, temperature=0, ignore_eos=True)
    with httpx.stream('POST', url + '/v1/completions', json=body, timeout=60) as r:
        assert next(l for l in r.iter_lines() if l.startswith('data: '))
        m = engine_metrics(url)
        assert sorted(per_rank(m, 'num_requests_running')) == [0, 1]     # the stream runs on one rank
        done = httpx.post(url + '/v1/completions', json=short, timeout=60).json()
        assert done['usage']['completion_tokens'] == 8           # served on the other rank, the stream still open
    after = dp_idle(url)
    assert after['vllm:request_success_total{finished_reason="abort"}'] == aborts + 1
    assert per_rank(after, 'kv_cache_usage_perc') == [0, 0]
    want = new_llm().generate('Henry wrote', SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].text
    assert done['choices'][0]['text'] == want
    again = httpx.post(url + '/v1/completions', json=short | {'max_tokens': 2}, timeout=60).json()
    assert again['usage']['completion_tokens'] == 2


@pytest.mark.processes
def test_dp_ctrl_c_ends_every_rank(dp_server):
    "Ctrl-C to `serve --data-parallel-size 2` mid-stream: the stream ends with 'abort', every rank ends, exit 0"
    p, url = dp_server
    events = []
    body = dict(model=MODEL, prompt='Once upon a time', max_tokens=200, ignore_eos=True, stream=True)
    ranks = descendants(p.pid)
    assert len([r for r in ranks if alive(r)]) >= 2
    with httpx.stream('POST', url + '/v1/completions', json=body, timeout=60) as r:
        for l in (l for l in r.iter_lines() if l.startswith('data: ')):
            events.append(l[6:])
            if len(events) == 2: code, err, _ = stop_serving(p)
    assert events[-1] == '[DONE]' and json.loads(events[-2])['choices'][0]['finish_reason'] == 'abort'
    assert code == 0 and 'Traceback' not in err, err


@pytest.mark.processes
def test_dp_serve_under_torchrun():
    "`torchrun --nproc-per-node 2 -m dsv41_nb serve`: rank 0 serves the one-process engine's text; Ctrl-C ends all"
    p, url = start_serving([sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '2',
                            '--master-port', str(free_port()), '-m', 'dsv41_nb', *DP_FLAGS])
    try:
        got = httpx.post(url + '/v1/completions', timeout=60, json=dict(
            model=MODEL, prompt='Ivy asked', max_tokens=6, temperature=0, ignore_eos=True)).json()
        want = new_llm().generate('Ivy asked', SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                  use_tqdm=False)[0].outputs[0].text
        assert got['choices'][0]['text'] == want
        assert per_rank(dp_idle(url), 'kv_cache_usage_perc') == [0, 0]
        code, err, ranks = stop_serving(p)
        # torchrun itself ends on the signal with a traceback of its own (SignalException); the ranks with none
        assert len(ranks) >= 2 and 'dsv41_nb' not in err and err.count('Traceback') <= 1, err
    finally:
        if p.poll() is None: p.kill()


def test_dp_serve_flags_refused_before_any_rank_starts(monkeypatch):
    "Bad numbers of ranks, a model that does not split, a bad device: the parser's error, nothing spawned"
    p = add_serve_arguments(argparse.ArgumentParser())
    def error(msg): raise ValueError(msg)
    rows = [(['--data-parallel-size', '0'], {}, '--data-parallel-size: N = 0; expected at least 1'),
            (['--data-parallel-size', '-2'], {}, 'N = -2'),
            (['--data-parallel-size', '3'], {}, '16 routed experts do not split evenly over 3 ranks'),
            (['--data-parallel-size', '2', '--device', 'tpu'], {}, "--device 'tpu'"),
            (['--data-parallel-size', '2', '--max-num-seqs', '0'], {}, 'max_num_seqs'),
            (['--data-parallel-size', '2', '--threads', '0'], {}, 'threads = 0'),
            (['--data-parallel-size', '2', '--checkpoint', str(ROOT / 'nowhere')], {}, 'nowhere'),
            (['--data-parallel-size', '3'], dict(RANK='0', WORLD_SIZE='2', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1',
                                                  MASTER_PORT='1'), '--data-parallel-size 3, but torchrun started 2'),
            (['--data-parallel-size', '2'], dict(RANK='0', WORLD_SIZE='2'), 'not LOCAL_RANK, MASTER_ADDR')]
    for flags, env, msg in rows:
        with monkeypatch.context() as m:
            for k, v in env.items(): m.setenv(k, v)
            with pytest.raises(ValueError) as e: serve(p.parse_args([*flags, '--port', '0']), error)
            assert msg in str(e.value), (flags, str(e.value))


def test_serve_refuses_a_bad_memory_share():
    "--gpu-memory-utilization outside (0, 1]: the parser's error before the server listens"
    p = add_serve_arguments(argparse.ArgumentParser())
    def error(msg): raise ValueError(msg)
    for u in ('0', '1.5', '-0.2'):
        with pytest.raises(ValueError) as e: serve(p.parse_args(['--gpu-memory-utilization', u, '--port', '0']), error)
        assert f'gpu_memory_utilization = {float(u)}' in str(e.value), str(e.value)
