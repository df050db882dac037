from configparser import ConfigParser
import setuptools, shlex, shutil
from pathlib import Path
from setuptools.command.build_py import build_py

# note: all settings are in settings.ini; edit there, not here
config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

cfg_keys = 'version description keywords author author_email'.split()
expected = cfg_keys + "lib_name user branch license status min_python audience language".split()
for o in expected: assert o in cfg, "missing expected setting: {}".format(o)
setup_cfg = {o:cfg[o] for o in cfg_keys}

licenses = {'apache2': 'Apache-2.0', 'mit': 'MIT'}  # SPDX expressions (license classifiers are deprecated)
statuses = [ '1 - Planning', '2 - Pre-Alpha', '3 - Alpha',
    '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive' ]
py_versions = '3.10 3.11 3.12 3.13'.split()

requirements = shlex.split(cfg.get('requirements', ''))
min_python = cfg['min_python']
lic = licenses.get(cfg['license'].lower(), cfg['license'])
dev_requirements = (cfg.get('dev_requirements') or '').split()

class build_py_with_checkpoint(build_py):
    "Copy the trained small checkpoint (checkpoints/small) into the package, so that a wheel serves it from any folder"
    def run(self):
        super().run()
        src = Path('checkpoints') / 'small'
        if (src / 'config.json').is_file():
            shutil.copytree(src, Path(self.build_lib) / cfg['lib_name'] / 'checkpoints' / 'small', dirs_exist_ok=True)

setuptools.setup(
    cmdclass = {'build_py': build_py_with_checkpoint},
    name = cfg['lib_name'],
    license_expression = lic,
    classifiers = [
        'Development Status :: ' + statuses[int(cfg['status'])],
        'Intended Audience :: ' + cfg['audience'].title(),
        'Natural Language :: ' + cfg['language'].title(),
    ] + ['Programming Language :: Python :: '+o for o in py_versions[py_versions.index(min_python):]],
    url = cfg['git_url'],
    packages = setuptools.find_packages(include=[cfg['lib_name'], cfg['lib_name'] + '.*']),
    include_package_data = True,
    install_requires = requirements,
    extras_require={ 'dev': dev_requirements },
    python_requires  = '>=' + cfg['min_python'],
    long_description = open('README.md', encoding='utf-8').read(),
    long_description_content_type = 'text/markdown',
    zip_safe = False,
    entry_points = {
        'console_scripts': cfg.get('console_scripts','').split(),
        'nbdev': [f'{cfg.get("lib_path")}={cfg.get("lib_path")}._modidx:d']
    },
    **setup_cfg)
